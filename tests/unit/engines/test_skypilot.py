"""`ddpkit sky` (engines/skypilot.py): the task YAML it writes (nodes, resources, the run
directory on a bucket or volume, the one `run` line, job recovery), the job description from a
config file's [launch] table under its flags, what it refuses in one line before writing, and
the YAML as SkyPilot's own loader reads it (skypilot_loader.py, in a Python with SkyPilot)."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ddpkit.cli import main

HERE = Path(__file__).resolve().parent


def _sky(tmp_path, capsys, *argv, name="t.yaml"):
    path = tmp_path / name
    assert main(["sky", "--yaml", str(path), *argv]) == 0, capsys.readouterr().err
    return path, yaml.safe_load(path.read_text())


def test_a_managed_job_on_two_gpu_nodes_with_its_run_dir_on_a_bucket(tmp_path, capsys):
    path, task = _sky(
        tmp_path,
        capsys,
        *("--nodes", "2", "--gpus-per-node", "8", "--accelerator", "H100", "--cloud", "aws"),
        *("--cpus-per-worker", "4", "--memory", "200GiB", "--image", "nvcr.io/nvidia/pytorch:24.01-py3"),
        *(
            "--bucket",
            "my-runs",
            "--job-name",
            "wine-big",
            "--install",
            "pip install ddpkit",
            "--install",
            "nvidia-smi",
        ),
        *("--max-restarts-on-errors", "2", "--", "wine", "--epochs", "3"),
    )
    maker = "DDPKIT_JOB_TOKEN=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')"  # two nodes: sealed
    launch = f"{maker} sky jobs launch -n wine-big --secret DDPKIT_JOB_TOKEN {path}"
    assert capsys.readouterr().out == f"ddpkit: wrote {path}; launch it with: {launch}\n"
    assert task["name"] == "wine-big" and task["num_nodes"] == 2
    assert task["resources"] == {
        "cloud": "aws",
        "accelerators": "H100:8",
        "cpus": "32+",  # 4 cores x 8 workers, at least
        "memory": "200+",
        "image_id": "docker:nvcr.io/nvidia/pytorch:24.01-py3",
        "job_recovery": {"strategy": "EAGER_NEXT_REGION", "max_restarts_on_errors": 2},
    }
    assert task["file_mounts"] == {"/ddpkit": {"name": "my-runs", "mode": "MOUNT"}}
    assert task["setup"] == "pip install ddpkit\nnvidia-smi\n"
    run = task["run"].split()
    # one line for every node: no placement flag (ddpkit reads SKYPILOT_*), the run dir on the bucket
    assert run[:5] == ["ddpkit", "train", "wine", "--epochs", "3"] and run[-1] == "--auto-resume"
    assert run[-3] == "--run-dir" and run[-2].startswith("/ddpkit/wine-big-") and len(task["run"].splitlines()) == 1


def test_the_launch_table_describes_the_job_and_the_flags_win(tmp_path, capsys):
    config = tmp_path / "job.toml"
    config.write_text(
        '[launch]\nnodes = 2\ngpus_per_node = 4\naccelerator = "A100"\ncloud = "kubernetes"\nimage = "docker:img:1"\n'
        'cpus_per_worker = 2\nmemory = "64GiB"\nvolume = "pvc-runs"\nrun_dir = "/ddpkit/exp1"\njob_name = "exp1"\n'
        "\n[training]\nepochs = 2\n"
    )
    _, task = _sky(tmp_path, capsys, "--config", str(config), "--", "wine")
    assert task["name"] == "exp1" and task["num_nodes"] == 2 and task["volumes"] == {"/ddpkit": "pvc-runs"}
    res = task["resources"]
    assert (res["cloud"], res["accelerators"], res["image_id"], res["cpus"], res["memory"]) == (
        "kubernetes",
        "A100:4",
        "docker:img:1",
        "8+",
        "64+",
    )
    # the config file travels to every node, where ddpkit train reads it (its [launch] table ignored)
    assert task["file_mounts"] == {"~/.ddpkit-job/job.toml": str(config)}
    assert (
        task["run"] == 'ddpkit train --config "$HOME/.ddpkit-job/"job.toml wine --run-dir /ddpkit/exp1 --auto-resume\n'
    )
    flags = ("--nodes", "3", "--gpus-per-node", "8", "--accelerator", "H100", "--job-name", "exp2", "--unmanaged")
    _, task = _sky(tmp_path, capsys, *flags, "--config", str(config), "--", "wine")
    assert (task["name"], task["num_nodes"], task["resources"]["accelerators"]) == ("exp2", 3, "H100:8")
    assert "job_recovery" not in task["resources"] and task["resources"]["cloud"] == "kubernetes"  # a plain task
    assert "sky launch -c exp2 --secret DDPKIT_JOB_TOKEN" in capsys.readouterr().out


def test_a_cpu_task_on_one_node_is_warned_that_a_recovery_starts_over(tmp_path, capsys):
    assert main(["sky", "--dry-run", "--job-name", "cpu", "--", "wine"]) == 0
    out, err = capsys.readouterr()
    task = yaml.safe_load(out)
    assert task["num_nodes"] == 1 and "accelerators" not in task["resources"] and "--run-dir runs/cpu-" in task["run"]
    assert err.startswith("ddpkit: warning: the run directory runs/cpu-") and "starts over" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--nodes", "2", "--", "wine"],
            "the run directory runs/ddpkit-* is on a node's disk, but the SkyPilot job spans 2 nodes: each would write "
            "and resume from its own copy. Put it on a bucket (--bucket NAME) or a shared volume (--volume NAME, "
            "volume in [launch]), under /ddpkit, or pass --shared-run-dir (shared_run_dir = true in [launch]) if "
            "every node does see it",
        ),
        (
            ["--nodes", "2", "--bucket", "b", "--run-dir", "/data/r", "--", "wine"],
            "the run directory /data/r is not under /ddpkit, where the bucket or volume is mounted, but *",
        ),
        (["--gpus-per-node", "8", "--", "wine"], "8 GPU(s) per node of which type? SkyPilot picks machines by it: *"),
        (["--accelerator", "H100:8", "--gpus-per-node", "4", "--", "wine"], "accelerator 'H100:8' says 8 GPU(s) *"),
        (["--bucket", "b", "--volume", "v", "--", "wine"], "give --bucket or --volume ([launch] volume) *"),
        (["--job-name", "a b", "--", "wine"], "job name 'a b': use letters, digits, *"),
        (
            ["--", "wine", "--nproc", "2"],
            "--nproc does not belong after --: SkyPilot starts the workers (use --nodes / --gpus-per-node of "
            "`ddpkit sky`)",
        ),
        (["--run-dir", "/ddpkit/a", "--", "wine", "--run-dir", "/ddpkit/b"], "two run directories: *"),
    ],
)
def test_what_skypilot_could_not_run_is_refused_in_one_line_before_writing(tmp_path, capsys, argv, message):
    assert main(["sky", "--yaml", str(tmp_path / "t.yaml"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    pattern = ".*".join(map(re.escape, ("ddpkit: error: " + message).split("*")))  # '*': any text
    assert len(err) == 1 and re.fullmatch(pattern, err[0]), err
    assert not (tmp_path / "t.yaml").exists()


def test_a_multi_node_job_s_run_dir_said_shared_or_only_a_dry_run_is_not_refused(tmp_path, capsys):
    _, task = _sky(tmp_path, capsys, "--nodes", "2", "--shared-run-dir", "--run-dir", "/nfs/r", "--", "wine")
    assert "--run-dir /nfs/r" in task["run"]
    assert main(["sky", "--dry-run", "--nodes", "2", "--", "wine"]) == 0
    assert capsys.readouterr().err.startswith("ddpkit: warning: the run directory runs/ddpkit-")


def test_a_config_file_that_places_workers_is_refused_naming_skypilot(tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text("[processes]\nnproc = 4\n")
    assert main(["sky", "--dry-run", "--config", str(config), "--", "wine"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"ddpkit: error: nproc = 4 in {config} does not belong in a SkyPilot job: SkyPilot starts the workers "
        "(remove it; use --nodes / --gpus-per-node of `ddpkit sky`)"
    )


# -- SkyPilot's own loader ------------------------------------------------------------------------


def _sky_python():
    """A Python with SkyPilot: DDPKIT_SKY_PYTHON, this one, or the repository's .venv-sky (`make
    .venv-sky`); SkyPilot pins click<8.2, which the test extras' wandb>=0.27 does not allow."""
    repo_venv = HERE.parents[2] / ".venv-sky" / "bin" / "python"
    if os.environ.get("DDPKIT_SKY_PYTHON"):
        return os.environ["DDPKIT_SKY_PYTHON"]
    if importlib.util.find_spec("sky") is not None:
        return sys.executable
    if repo_venv.exists():
        return str(repo_venv)
    pytest.skip(
        "needs SkyPilot: `make .venv-sky` (pip install 'ddpkit[sky]' in a venv of its own), or DDPKIT_SKY_PYTHON"
    )


def _load_with_skypilot(tmp_path, paths):
    """What SkyPilot's loader made of each YAML; without network where this can make a network
    namespace (root): nothing may be fetched to load a task."""
    argv = [_sky_python(), str(HERE / "skypilot_loader.py"), *map(str, paths)]
    if os.geteuid() == 0 and shutil.which("unshare"):
        argv = ["unshare", "--net", *argv]
    home = tmp_path / "home"  # SkyPilot writes ~/.sky (a user hash, locks)
    home.mkdir()
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home)}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_skypilot_s_own_loader_reads_what_ddpkit_sky_writes(tmp_path, capsys):
    config = tmp_path / "job.toml"
    config.write_text('[launch]\nnodes = 2\ncloud = "kubernetes"\nvolume = "pvc-runs"\n\n[training]\nepochs = 2\n')
    managed, _ = _sky(
        tmp_path,
        capsys,
        *("--nodes", "2", "--gpus-per-node", "8", "--accelerator", "H100", "--cloud", "aws", "--cpus-per-worker", "4"),
        *("--memory", "200GiB", "--image", "nvcr.io/nvidia/pytorch:24.01-py3", "--bucket", "s3://my-runs"),
        *("--install", "pip install ddpkit", "--workdir", str(tmp_path), "--recovery", "FAILOVER", "--", "wine"),
        name="managed.yaml",
    )
    volume, _ = _sky(tmp_path, capsys, "--config", str(config), "--unmanaged", "--", "wine", name="volume.yaml")
    broken = tmp_path / "broken.yaml"  # the loader is a real check: a key SkyPilot does not know is refused
    broken.write_text(managed.read_text().replace("num_nodes:", "num_node:"))
    m, v, b = _load_with_skypilot(tmp_path, [managed, volume, broken])
    assert m["ok"] and v["ok"], (m, v)
    assert (m["num_nodes"], m["cloud"], m["accelerators"], m["cpus"], m["memory"]) == (
        2,
        "aws",
        {"H100": 8},
        "32+",
        "200+",
    )
    assert list(m["image_id"].values()) == ["docker:nvcr.io/nvidia/pytorch:24.01-py3"]
    assert m["job_recovery"] == {"strategy": "FAILOVER", "max_restarts_on_errors": 0} and m["strategy_known"]
    assert m["storage"] == {"/ddpkit": {"name": None, "source": "s3://my-runs", "mode": "MOUNT"}}
    assert m["workdir"] == str(tmp_path) and m["setup"] == "pip install ddpkit\n"
    assert m["run"].startswith("ddpkit train wine --run-dir /ddpkit/ddpkit-")
    assert (v["num_nodes"], v["cloud"], v["volumes"], v["job_recovery"]) == (
        2,
        "kubernetes",
        {"/ddpkit": "pvc-runs"},
        None,
    )
    assert v["file_mounts"] == {"~/.ddpkit-job/job.toml": str(config)}
    assert not b["ok"] and "num_node" in b["error"] and "num_nodes" in b["error"]


def test_a_two_node_task_keeps_its_run_in_a_bucket_with_secrets_by_name_only(tmp_path, capsys, monkeypatch):
    """--run-dir s3://... on two nodes: each node's `ddpkit train` keeps the run at the URL (no
    mount); --secret names what SkyPilot passes from the launching shell: SkyPilot's loader reads
    them as references to resolve at launch, and no value of this environment is in the YAML."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "in-the-environment-never-in-the-yaml")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key-id-never-in-the-yaml")
    args = ("--nodes", "2", "--run-dir", "s3://ckpt/runs/wine", "--secret", "AWS_ACCESS_KEY_ID")
    path, task = _sky(tmp_path, capsys, *args, "--secret", "AWS_SECRET_ACCESS_KEY", "--", "wine", name="bucket.yaml")
    out = capsys.readouterr().out
    assert (
        "sky jobs launch -n ddpkit --secret AWS_ACCESS_KEY_ID --secret AWS_SECRET_ACCESS_KEY --secret DDPKIT_JOB_TOKEN "
        in out
    )
    secrets = ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "DDPKIT_JOB_TOKEN"]  # the token: two nodes
    text = path.read_text()
    assert "never-in-the-yaml" not in text
    assert task["secrets"] == dict.fromkeys(secrets) and "file_mounts" not in task
    (loaded,) = _load_with_skypilot(tmp_path, [path])
    assert loaded["ok"] and loaded["num_nodes"] == 2, loaded
    assert loaded["secrets"] == {} and loaded["secret_refs"] == secrets, loaded
    assert loaded["run"].strip() == "ddpkit train wine --run-dir s3://ckpt/runs/wine --auto-resume", loaded
    assert loaded["storage"] == {} and loaded["volumes"] in (None, {}), loaded


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--secret", "AWS_SECRET_ACCESS_KEY=abc"), "--secret AWS_SECRET_ACCESS_KEY=...: give the name only"),
        (("--run-dir", "s3://ckpt/x", "--bucket", "my-runs"), "needs no mounted --bucket or --volume; give one"),
    ],
)
def test_a_secret_value_or_a_bucket_url_beside_a_mount_is_refused_in_one_line(tmp_path, capsys, argv, message):
    assert main(["sky", "--yaml", str(tmp_path / "t.yaml"), *argv, "--", "wine"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "abc" not in err, err
    assert not (tmp_path / "t.yaml").exists()


def test_a_multi_node_task_is_sealed_by_a_job_token_made_at_launch(tmp_path, capsys, monkeypatch):
    """Two nodes: DDPKIT_JOB_TOKEN is one of the task's secrets (by name), and the launch line makes
    a fresh one in the launching shell for that launch only; SkyPilot's loader reads it as a
    reference. One node needs none."""
    monkeypatch.setenv("DDPKIT_JOB_TOKEN", "a-token-of-this-shell-never-in-the-yaml")
    path, task = _sky(tmp_path, capsys, "--nodes", "2", "--shared-run-dir", "--", "wine", name="two.yaml")
    out = capsys.readouterr().out
    assert task["secrets"] == {"DDPKIT_JOB_TOKEN": None}, task
    assert "never-in-the-yaml" not in path.read_text()
    maker = "DDPKIT_JOB_TOKEN=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))') "
    assert f"{maker}sky jobs launch -n ddpkit --secret DDPKIT_JOB_TOKEN " in out, out
    (loaded,) = _load_with_skypilot(tmp_path, [path])
    assert loaded["ok"] and loaded["secret_refs"] == ["DDPKIT_JOB_TOKEN"], loaded
    _, one = _sky(tmp_path, capsys, "--", "wine", name="one.yaml")
    assert "secrets" not in one and "DDPKIT_JOB_TOKEN" not in capsys.readouterr().out
