"""Run folders in a bucket, against a real S3-compatible server on loopback (moto's): train,
commit (every object, the manifest last), resume, equal to the same run on a local disk; the
commit rule under a crash; the store's failures in one line, before any worker starts."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, max_abs_diff, run_ddpkit

COMMON = ("--nproc", "2", "--seed", "5", "--save-every", "2", "--quiet")
FSDP = ("--strategy", "fsdp", *COMMON)  # test_integrity's FSDP reference run, shared
MANIFEST = ".manifest.json"


def _model(s3, bucket: str, prefix: str) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(s3.get(bucket, f"{prefix}/model.pt")), weights_only=True)


def _env(s3, tmp_path) -> dict[str, str]:
    return {**s3.env, "TMPDIR": str(tmp_path)}  # the staging folder, where the test can see it


def test_fsdp_run_in_a_bucket_resumes_from_the_newest_committed_checkpoint_and_equals_a_local_run(
    s3_server, reference_run, tmp_path
):
    s3, bucket = s3_server, s3_server.bucket("runs")
    url = f"s3://{bucket}/wine/fsdp"
    puts: list[str] = []
    s3.on_request = lambda method, path: method == "PUT" and puts.append(path.split("/checkpoints/")[-1]) and False
    try:
        run_ddpkit("train", *FSDP, "--epochs", "4", "--run-dir", url, env=_env(s3, tmp_path))
    finally:
        s3.on_request = None
    # each rank's shards, rank 1's report of them, then (last of that checkpoint) rank 0's manifest
    mine = [p for p in puts if p.startswith("epoch-000004")]
    assert mine[-1] == f"epoch-000004{MANIFEST}" and "epoch-000004.reports/1.json" in mine, mine
    assert {"epoch-000004/__0_0.distcp", "epoch-000004/__1_0.distcp", "epoch-000004/.metadata"} <= set(mine), mine
    keys = s3.keys(bucket, "wine/fsdp/")
    assert not [k for k in keys if ".reports/" in k], "a committed checkpoint's reports stayed"
    for name in ("epoch-000002", "epoch-000004"):
        assert f"wine/fsdp/checkpoints/{name}{MANIFEST}" in keys
        assert f"wine/fsdp/checkpoints/{name}/__1_0.distcp" in keys  # every rank's shards
    assert {"wine/fsdp/model.pt", "wine/fsdp/summary.json", "wine/fsdp/metrics.jsonl"} <= set(keys)
    assert json.loads(s3.get(bucket, "wine/fsdp/config.json"))["run_dir"] == url
    assert not list(tmp_path.glob("ddpkit-stage-*")), "the staging folder outlived the run"

    # a crash's leftovers: objects of a newer checkpoint whose manifest never came (not committed:
    # never resumed from), and a committed one damaged afterwards (skipped in one line)
    ckpt = "wine/fsdp/checkpoints"
    for key in s3.keys(bucket, f"{ckpt}/epoch-000004/"):
        data = s3.get(bucket, key)
        s3.put(bucket, key.replace("epoch-000004/", "epoch-000005-step-000001/"), data)
        damaged = data[:-8] + bytes(b ^ 0xFF for b in data[-8:]) if key.endswith("__0_0.distcp") else data
        s3.put(bucket, key.replace("epoch-000004/", "epoch-000005/"), damaged)
    s3.put(bucket, f"{ckpt}/epoch-000005{MANIFEST}", s3.get(bucket, f"{ckpt}/epoch-000004{MANIFEST}"))

    proc = run_ddpkit("train", *FSDP[:-1], "--epochs", "6", "--resume", "--run-dir", url, env=_env(s3, tmp_path))
    out = proc.stdout + proc.stderr
    skipped = [line for line in out.splitlines() if "skipping checkpoint" in line]
    assert len(skipped) == 1 and "epoch-000005: object __0_0.distcp fails its CRC-32 check" in skipped[0], out
    assert f"resuming from {url}/checkpoints/epoch-000004 (epoch 4 done)" in out, out
    assert not s3.keys(bucket, f"{ckpt}/epoch-000005-step-000001"), "an uncommitted checkpoint's objects stayed"
    reference = torch.load(reference_run(*FSDP, "--epochs", "6") / "model.pt", weights_only=True)
    assert max_abs_diff(_model(s3, bucket, "wine/fsdp"), reference) <= 1e-6
    lines = json.loads(s3.get(bucket, "wine/fsdp/summary.json"))
    assert lines["run_dir"] == url

    # the commands that read a run take the URL: export and plot download it, --init-from its model.pt
    run_ddpkit("export", url, "--out", str(tmp_path / "exported"), env=_env(s3, tmp_path))
    from safetensors.torch import load_file

    assert max_abs_diff(load_file(str(tmp_path / "exported" / "model.safetensors")), reference) <= 1e-6
    (listed,) = json.loads(run_ddpkit("runs", url, "--json", env=_env(s3, tmp_path)).stdout)
    assert listed["path"] == url and listed["run"] == "fsdp" and listed["world_size"] == 2, listed
    assert listed["resumable"] and listed["checkpoint"] == f"{url}/checkpoints/epoch-000006", listed
    run_ddpkit("plot", url, "--out", str(tmp_path / "curves.png"), env=_env(s3, tmp_path))
    assert (tmp_path / "curves.png").stat().st_size > 1000
    init = run_ddpkit(
        "train", "--nproc", "1", "--epochs", "1", "--lr", "1e-12", "--init-from", f"{url}/model.pt",
        "--run-dir", str(tmp_path / "from-bucket"), env=_env(s3, tmp_path),
    )  # fmt: skip
    assert max_abs_diff(torch.load(tmp_path / "from-bucket" / "model.pt", weights_only=True), reference) <= 1e-6, init
    assert not list(tmp_path.glob("ddpkit-*")), "a download outlived its command"

    secret = s3.env["AWS_SECRET_ACCESS_KEY"].encode()  # ddpkit stores and prints no credential
    assert all(secret not in s3.get(bucket, key) for key in s3.keys(bucket))
    assert secret.decode() not in out


def _until_killed(s3, args: tuple[str, ...], env: dict[str, str], path_part: str, timeout: float = 120) -> None:
    """`ddpkit train ARGS`, killed with SIGKILL (the launcher and its workers: a pod that dies)
    when the server receives the first PUT whose path holds `path_part`, before serving it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "train", *args],
        env={**os.environ, "PYTHONPATH": str(REPO / "src"), **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    hit = []

    def kill(method: str, path: str) -> bool:
        if method == "PUT" and path_part in path and not hit:
            hit.append(path)
            os.killpg(proc.pid, signal.SIGKILL)
            return True  # the object being sent when the launcher died never arrives
        return False

    s3.on_request = kill
    try:
        proc.wait(timeout=timeout)
    finally:
        s3.on_request = None
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert hit, f"the run ended (exit {proc.returncode}) before uploading {path_part}"


@pytest.mark.parametrize(
    "args, moment",
    [
        (COMMON, "checkpoints/epoch-000004.pt"),  # in the middle of the second checkpoint's upload
        (COMMON, f"checkpoints/epoch-000004.pt{MANIFEST}"),  # every object up, the manifest not yet
        (FSDP, "checkpoints/epoch-000004.reports/1.json"),  # rank 1's shards up and reported, no manifest
    ],
    ids=["ddp-object", "ddp-manifest", "fsdp-report"],
)
def test_kill_9_during_an_upload_resumes_from_the_newest_committed_checkpoint_exactly(
    args, moment, s3_server, reference_run, tmp_path
):
    s3 = s3_server
    bucket = s3.bucket(f"kill-{abs(hash(moment)) % 10**8}")
    url = f"s3://{bucket}/run"
    _until_killed(s3, (*args, "--epochs", "6", "--run-dir", url), _env(s3, tmp_path), moment)
    assert not [k for k in s3.keys(bucket) if k.startswith(f"run/checkpoints/epoch-000004{MANIFEST}")]
    assert not [k for k in s3.keys(bucket) if k.startswith(f"run/checkpoints/epoch-000004.pt{MANIFEST}")]
    proc = run_ddpkit("train", *args[:-1], "--epochs", "6", "--resume", "--run-dir", url, env=_env(s3, tmp_path))
    newest = "epoch-000002.pt" if args is COMMON else "epoch-000002"
    assert f"resuming from {url}/checkpoints/{newest} (epoch 2 done)" in proc.stdout, proc.stdout
    reference = torch.load(reference_run(*args, "--epochs", "6") / "model.pt", weights_only=True)
    assert max_abs_diff(_model(s3, bucket, "run"), reference) <= 1e-6


@pytest.mark.parametrize(
    "where, says",
    [
        ("down", "cannot reach the object store for s3://runs/x"),
        ("no-bucket", "s3://no-such-bucket/x: no such bucket 'no-such-bucket'"),
    ],
)
def test_an_unusable_bucket_is_one_line_before_any_worker_starts(where, says, s3_server, tmp_path):
    env = _env(s3_server, tmp_path)
    url = "s3://no-such-bucket/x" if where == "no-bucket" else "s3://runs/x"
    if where == "down":
        import socket

        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{s.getsockname()[1]}"
    start = time.monotonic()
    proc = run_ddpkit("train", *COMMON, "--epochs", "2", "--run-dir", url, env=env, check=False, timeout=90)
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 2 and time.monotonic() - start < 90, out
    assert says in out and "Traceback" not in out and len(out.splitlines()) <= 3, out
    assert not (tmp_path / "s3:").exists() and not list(tmp_path.glob("ddpkit-stage-*"))


OWN_LOOP = str(REPO / "tests" / "distributed" / "scripts" / "own_loop_bucket.py")


def test_an_own_loops_save_and_load_take_a_bucket_url_and_commit_by_the_manifest(s3_server, tmp_path):
    """rt.save / rt.load with s3://: a file and a sharded folder of an FSDP model, each committed
    by its manifest last, load back equal (into a plain and an FSDP model); no local folder 's3:'.
    A save whose manifest is gone (killed before its commit) is not loaded: one line."""
    s3, bucket = s3_server, s3_server.bucket("own")
    url, out = f"s3://{bucket}/loop", tmp_path / "out"
    run_ddpkit("launch", "--nproc", "2", OWN_LOOP, url, str(out), env=_env(s3, tmp_path), cwd=tmp_path)
    keys = set(s3.keys(bucket, "loop/"))
    assert {"loop/final.pt", f"loop/final.pt{MANIFEST}", f"loop/final-sharded{MANIFEST}"} <= keys, keys
    assert {"loop/final-sharded/__0_0.distcp", "loop/final-sharded/__1_0.distcp"} <= keys, keys
    assert not [k for k in keys if ".reports/" in k] and not (tmp_path / "s3:").exists()
    assert not list(tmp_path.glob("ddpkit-stage-*")), "a staging folder outlived the job"
    trained = torch.load(out / "trained.pt", weights_only=True)
    for loaded in ("whole.pt", "sharded.pt"):
        assert max_abs_diff(torch.load(out / loaded, weights_only=True), trained) == 0, loaded
    saved = torch.load(io.BytesIO(s3.get(bucket, "loop/final.pt")), weights_only=True)
    assert max_abs_diff(saved["model"], trained) == 0  # the object is the file a local save writes

    s3.client.delete_object(Bucket=bucket, Key=f"loop/final.pt{MANIFEST}")  # as if killed before the commit
    script = tmp_path / "loads.py"
    script.write_text(
        "import ddpkit, torch\n"
        "with ddpkit.init(device='cpu') as rt:\n"
        f"    rt.load('{url}/final.pt', torch.nn.Linear(8, 16))\n"
    )
    proc = run_ddpkit("launch", "--nproc", "1", str(script), env=_env(s3, tmp_path), check=False, timeout=120)
    assert proc.returncode != 0 and f"{url}/final.pt: no committed save of that name" in proc.stderr, proc.stderr


def test_export_and_plot_write_their_out_url_to_the_bucket_not_to_a_local_folder(s3_server, tmp_path):
    s3, bucket = s3_server, s3_server.bucket("outs")
    env = _env(s3, tmp_path)
    run_ddpkit("train", "--nproc", "1", "--epochs", "1", "--quiet", "--run-dir", "run", env=env, cwd=tmp_path)
    out = run_ddpkit("export", "run", "--out", f"s3://{bucket}/export/wine", env=env, cwd=tmp_path).stdout
    assert f"s3://{bucket}/export/wine" in out and "ddpkit-out-" not in out, out
    from safetensors.torch import load

    exported = load(s3.get(bucket, "export/wine/model.safetensors"))
    assert max_abs_diff(exported, torch.load(tmp_path / "run" / "model.pt", weights_only=True)) == 0
    again = run_ddpkit("export", "run", "--out", f"s3://{bucket}/export/wine", env=env, cwd=tmp_path, check=False)
    assert again.returncode == 2 and "already holds objects" in again.stderr, again.stderr
    said = run_ddpkit("plot", "run", "--out", f"s3://{bucket}/curves.png", env=env, cwd=tmp_path).stdout
    assert said.strip() == f"wrote s3://{bucket}/curves.png" and len(s3.get(bucket, "curves.png")) > 1000
    assert not (tmp_path / "s3:").exists() and not list(tmp_path.glob("ddpkit-out-*"))


def test_a_full_bucket_ends_the_run_in_one_line_and_the_resume_continues_from_the_last_committed(
    s3_server, reference_run, tmp_path
):
    """The store fills up (a MinIO-style 507 XMinioStorageFull for every upload of the second
    checkpoint): the run ends non-zero in one line naming the URL and the quota, the first
    checkpoint stays committed, the second never is; freed, --resume continues exactly."""
    s3, bucket = s3_server, s3_server.bucket("full")
    url = f"s3://{bucket}/run"
    s3.on_request = lambda method, path: (
        method == "PUT" and "checkpoints/epoch-000004" in path and ("507 Insufficient Storage", "XMinioStorageFull")
    )
    try:
        proc = run_ddpkit("train", *COMMON, "--epochs", "6", "--run-dir", url, env=_env(s3, tmp_path), check=False)
    finally:
        s3.on_request = None
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ddpkit: error:")]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert len(errors) == 1 and url in errors[0] and "full" in errors[0] and "quota" in errors[0], proc.stderr
    keys = s3.keys(bucket, "run/checkpoints/")
    assert f"run/checkpoints/epoch-000002.pt{MANIFEST}" in keys and not [k for k in keys if "epoch-000004" in k], keys
    resumed = run_ddpkit("train", *COMMON[:-1], "--epochs", "6", "--resume", "--run-dir", url, env=_env(s3, tmp_path))
    assert f"resuming from {url}/checkpoints/epoch-000002.pt (epoch 2 done)" in resumed.stdout, resumed.stdout
    reference = torch.load(reference_run(*COMMON, "--epochs", "6") / "model.pt", weights_only=True)
    assert max_abs_diff(_model(s3, bucket, "run"), reference) <= 1e-6


def test_check_probes_a_bucket_run_folder_from_every_rank_and_leaves_no_local_folder(s3_server, tmp_path):
    s3, bucket = s3_server, s3_server.bucket("checked")
    env = _env(s3, tmp_path)
    proc = run_ddpkit("check", "--nproc", "2", "--run-dir", f"s3://{bucket}/run", env=env, cwd=tmp_path, check=False)
    row = [line for line in proc.stdout.splitlines() if "run directory" in line]
    assert row and "OK" in row[0] and f"s3://{bucket}/run: every rank reached the bucket" in row[0], proc.stdout
    assert not s3.keys(bucket) and not (tmp_path / "s3:").exists()  # the test objects are gone, no folder 's3:'
    proc = run_ddpkit(
        "check", "--nproc", "2", "--run-dir", "s3://no-such-bucket/run", env=env, cwd=tmp_path, check=False
    )
    row = [line for line in proc.stdout.splitlines() if "run directory" in line]
    assert proc.returncode != 0 and row and "FAIL" in row[0] and "no such bucket 'no-such-bucket'" in row[0], (
        proc.stdout
    )
