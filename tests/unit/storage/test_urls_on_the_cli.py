"""A URL given as the run folder is never silently a local folder named 's3:': a scheme whose
backend is not installed, one ddpkit cannot store at, or a URL with its slashes collapsed is
one line on the command line, exit 2, and nothing written where the command ran."""

import subprocess
import sys

import pytest

from conftest import REPO

# s3fs blocked in the process (a machine without the extra); gcsfs is not a test dependency at all
_BLOCKED = "import sys; sys.modules['s3fs'] = None; from ddpkit.cli import main; raise SystemExit(main())"


def _env(tmp_path) -> dict[str, str]:
    """A bare environment: no credentials, no backend settings of this machine."""
    return {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "src"), "HOME": str(tmp_path)}


@pytest.mark.parametrize(
    "url, says",
    [
        ("s3://ckpt/x", "s3://ckpt/x: a run at s3:// needs fsspec and s3fs, not installed: pip install 'ddpkit[s3]'"),
        ("gs://ckpt/x", "gs://ckpt/x: a run at gs:// needs fsspec and gcsfs, not installed: pip install fsspec gcsfs"),
        ("s3:/ckpt/x", "write s3://ckpt/x"),
        ("ftp://host/x", "cannot store a run at ftp:// URLs"),
    ],
)
def test_a_url_that_cannot_be_used_is_one_line_and_no_local_folder(url, says, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKED, "train", "--epochs", "1", "--quiet", "--run-dir", url],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 2 and "Traceback" not in out, out
    assert says in out and len(out.splitlines()) == 1, out
    assert list(tmp_path.iterdir()) == [] or all(p.name.startswith(".") for p in tmp_path.iterdir()), list(
        tmp_path.iterdir()
    )


@pytest.mark.parametrize("command", [("slurm", "--nodes", "2", "--dry-run", "--", "wine"), ("ray", "--dry-run", "--")])
def test_slurm_and_ray_refuse_a_bucket_run_folder_rather_than_turn_it_into_a_path(command, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ddpkit", *command, "--run-dir", "s3://ckpt/x"],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 2 and len(out.splitlines()) == 1, out
    assert "--run-dir s3://ckpt/x: a SLURM or Ray job does not take a bucket run folder" in out, out
    assert "`ddpkit k8s` or `ddpkit sky`, which do" in out, out
    assert not (tmp_path / "s3:").exists()


def _k8s(*args: str, tmp_path) -> subprocess.CompletedProcess:
    env = _env(tmp_path)
    env["AWS_SECRET_ACCESS_KEY"] = "in-the-environment-never-in-the-yaml"
    return subprocess.run(
        [sys.executable, "-m", "ddpkit", "k8s", "--image", "img", "--run-dir", "s3://ckpt/x", *args, "--dry-run"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize("nodes", ["1", "3"])
@pytest.mark.parametrize("kind", [(), ("--pytorchjob",)], ids=["trainjob", "pytorchjob"])
def test_a_k8s_job_takes_a_bucket_run_folder_and_its_credentials_by_a_secret_reference(kind, nodes, tmp_path):
    """On any number of nodes (each pod stages the run and uploads its shards): every pod's
    command names the URL, every container's environment comes from the Secret by reference, and
    no credential of the environment ddpkit ran in is in the YAML (Kubeflow's models checked it)."""
    import yaml

    proc = _k8s("--nodes", nodes, "--workers-per-node", "2", "--env-secret", "s3-creds", *kind, tmp_path=tmp_path)
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr
    docs = list(yaml.safe_load_all(proc.stdout))
    text = proc.stdout
    assert "in-the-environment-never-in-the-yaml" not in text and "AWS_" not in text
    containers = [c for c in _walk(docs, "containers") for c in c]
    assert containers and all(c["envFrom"] == [{"secretRef": {"name": "s3-creds"}}] for c in containers), containers
    commands = [c["command"] for c in containers if "command" in c] + list(_walk(docs, "command"))
    assert commands and all(cmd[cmd.index("--run-dir") + 1] == "s3://ckpt/x" for cmd in commands), commands
    pods = sum(spec.get("replicas", 1) for spec in _walk(docs, "pytorchReplicaSpecs") for spec in spec.values())
    assert (pods if kind else next(_walk(docs, "numNodes"))) == int(nodes), docs
    assert not list(_walk(docs, "volumes")) and not list(_walk(docs, "persistentVolumeClaim")), docs


def test_a_k8s_job_with_a_bucket_run_folder_and_a_volume_is_refused(tmp_path):
    proc = _k8s("--nodes", "2", "--volume", "runs", tmp_path=tmp_path)
    assert proc.returncode == 2 and "a run in a bucket needs no volume; give one of them" in proc.stderr, proc.stderr


def _walk(node, key):
    """Every value under `key` anywhere in parsed YAML."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                yield v
            yield from _walk(v, key)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v, key)


@pytest.mark.parametrize("nodes", ["1", "2"])
def test_a_skypilot_task_runs_train_on_the_bucket_url(nodes, tmp_path):
    env = _env(tmp_path)
    env["AWS_SECRET_ACCESS_KEY"] = "in-the-environment-never-in-the-yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "ddpkit", "sky", "--nodes", nodes, "--run-dir", "s3://ckpt/x", "--dry-run"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr
    assert "ddpkit train --run-dir s3://ckpt/x --auto-resume" in proc.stdout, proc.stdout
    assert "in-the-environment-never-in-the-yaml" not in proc.stdout and "AWS_" not in proc.stdout


@pytest.mark.parametrize("command", ["train", "launch"])
def test_a_log_dir_url_is_refused_rather_than_turned_into_a_local_folder(command, tmp_path):
    (tmp_path / "script.py").write_text("print('ran')\n")
    args = ["--nproc", "2", "--log-dir", "s3://ckpt/logs"] + (
        ["script.py"] if command == "launch" else ["--epochs", "1"]
    )
    proc = subprocess.run(
        [sys.executable, "-m", "ddpkit", command, *args],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 2 and len(out.splitlines()) == 1 and "--log-dir s3://ckpt/logs: " in out, out
    assert not (tmp_path / "s3:").exists() and "ran" not in out
