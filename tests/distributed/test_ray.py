"""ddpkit in Ray Train's workers, on a real Ray cluster of two nodes on this machine (`ray start
--head` on loopback, and a second `ray start` that joins it, one CPU each, so that a job of two
workers spread one per node): the model of `ddpkit train --nproc 2`, bit for bit; a worker killed
mid-run, restarted by Ray, resumed from RUN_DIR to the same model; a task's error as ddpkit's one
line; an own loop's ddpkit.init() inside a user's TorchTrainer. Ray's state stays in the test's
folder (--temp-dir, HOME), and every process of the cluster is stopped by its id at the end."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from conftest import OWN_LOOP, OWN_LOOP_EPOCHS, REPO, assert_state_close, assert_state_equal, load_model, run_ddpkit

pytest.importorskip("ray.train", reason="needs Ray Train: the ray extra (pip install 'ddpkit[ray]')")
pytestmark = pytest.mark.slow

TASKS = str(Path(__file__).parent / "scripts" / "ray_tasks.py")
OWN_LOOP_ON_RAY = str(Path(__file__).parent / "scripts" / "ray_own_loop.py")
SGD = [f"{TASKS}:sgd", "--seed", "5", "--save-every", "2", "--epochs", "6"]
RAY = ["--workers", "2", "--nodes", "2", "--shared-run-dir"]  # one machine: its disk is both nodes'


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sessions_pids(sessions: set[int]) -> list[int]:
    """Every process in the sessions our `ray start`s lead (Ray's daemons and workers stay in them)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[3]) in sessions:
                    found.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return found


def _alive_nodes(address: str, env: dict) -> int:
    probe = f"import ray; ray.init(address={address!r}); print(sum(n['Alive'] for n in ray.nodes()))"
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    return int(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 and proc.stdout.strip() else 0


@pytest.fixture(scope="module")
def ray_cluster():
    """(address, env): a head node and a second node, each `ray start --block` in a session of its
    own; the environment a driver of this cluster needs (ddpkit's source, Ray's state here)."""
    home = Path(tempfile.mkdtemp(prefix="ddpray", dir="/tmp"))  # short: Ray's socket paths live under it
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "src"),
        "HOME": str(home),  # Ray writes ~/.ray
        "RAY_AUTH_MODE": "disabled",  # else a token in ~/.ray for a cluster on loopback
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_DEDUP_LOGS": "0",
    }
    port = _port()
    address = f"127.0.0.1:{port}"
    ray = [str(Path(sys.executable).parent / "ray"), "start", "--node-ip-address", "127.0.0.1", "--num-cpus", "1"]
    starts = [
        [*ray, "--head", "--port", str(port), "--temp-dir", str(home / "h"), "--include-dashboard", "false"],
        [*ray, "--address", address, "--temp-dir", str(home / "w")],
    ]
    procs, logs = [], []
    try:
        for i, argv in enumerate(starts):
            logs.append(log := open(home / f"node{i}.log", "w"))
            procs.append(
                subprocess.Popen([*argv, "--block"], env=env, cwd=home, stdout=log, stderr=log, start_new_session=True)
            )
            deadline = time.monotonic() + 180
            while _alive_nodes(address, env) < i + 1:
                assert procs[-1].poll() is None, (home / f"node{i}.log").read_text()
                assert time.monotonic() < deadline, f"Ray node {i} did not join"
                time.sleep(1)
        yield address, env
    finally:
        sessions = {p.pid for p in procs}
        for pid in _sessions_pids(sessions):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            p.wait(timeout=30)
        for log in logs:
            log.close()
        deadline = time.monotonic() + 30  # the killed daemons' own children are reaped by init
        while _sessions_pids(sessions) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _sessions_pids(sessions)
        shutil.rmtree(home, ignore_errors=True)
        assert not left, f"Ray processes left running: {left}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("ray-ref") / "run"
    run_ddpkit("train", *SGD, "--nproc", "2", "--quiet", "--run-dir", str(run))
    return load_model(run)


def test_two_ray_workers_on_two_nodes_train_the_model_of_ddpkit_train_nproc_2(ray_cluster, reference, tmp_path):
    """Through the Python entry point: ddpkit.train_on_ray returns rank 0's summary."""
    address, env = ray_cluster
    run = tmp_path / "run"
    driver = (
        "import json, ddpkit\n"
        "from ddpkit.config.launch import LaunchTable\n"
        f"cfg = ddpkit.RunConfig(task={SGD[0]!r}, seed=5, save_every=2, epochs=6, run_dir={str(run)!r}, quiet=True)\n"
        f"summary = ddpkit.train_on_ray(cfg, workers=2, address={address!r}, "
        "launch=LaunchTable(nodes=2, shared_run_dir=True))\n"
        "print('SUMMARY', json.dumps(summary))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", driver], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.split("SUMMARY ", 1)[1].splitlines()[0])
    assert (summary["world_size"], summary["backend"], summary["epochs_done"]) == (2, "gloo", 6)
    assert_state_equal(load_model(run), reference)
    assert (run / "checkpoints" / "epoch-000006.pt").is_file() and (run / "ray").is_dir()  # Ray's files in RUN_DIR


def test_a_killed_worker_is_restarted_by_ray_and_the_run_resumes_to_the_same_model(ray_cluster, reference, tmp_path):
    address, env = ray_cluster
    run, marker = tmp_path / "run", tmp_path / "killed"
    kill = ["--task-arg", "kill_at=20", "--task-arg", f"marker={marker}"]  # rank 1, in epoch 5, once
    args = ["ray", *RAY, "--address", address, "--", *SGD, "--max-restarts", "1", "--run-dir", str(run), *kill]
    proc = run_ddpkit(*args, env=env, cwd=tmp_path, timeout=500)
    assert marker.is_file()  # rank 1's process was killed
    assert "ddpkit: Ray restarted the workers after a failure (restart 1 of 1" in proc.stdout
    assert f"ddpkit: resuming from {run}/checkpoints/epoch-000004.pt" in proc.stdout
    assert_state_close(load_model(run), reference, rtol=0, atol=1e-5)


def test_rank_1_s_task_error_reaches_the_user_as_ddpkit_s_one_line_not_a_ray_traceback(ray_cluster, tmp_path):
    """Rank 1's error and last lines reach the driver, as under `ddpkit train` (Ray shows rank 0's)."""
    address, env = ray_cluster
    args = ["ray", *RAY, "--address", address, "--", f"{TASKS}:raises", "--run-dir", str(tmp_path / "run")]
    proc = run_ddpkit(*args, env=env, cwd=tmp_path, check=False, timeout=400)
    assert proc.returncode == 1, proc.stderr[-4000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        "ddpkit: error: worker rank 1 raised ValueError: the data set at /data/wine is missing; "
        "the other workers were stopped (its last lines are above)"
    ), proc.stderr[-4000:]
    above = proc.stderr.split("ddpkit: rank 1's last lines", 1)[1]
    assert 'raise ValueError("the data set at /data/wine is missing")' in above, proc.stderr[-4000:]
    assert "rank 1 looks for its data" in proc.stderr  # what it printed before (Ray forwards it)
    assert "WorkerGroupError" not in proc.stderr and "FailurePolicy" not in proc.stderr  # Ray's own report


def test_an_own_loop_joins_the_process_group_of_a_users_torch_trainer(ray_cluster, own_loop_launched, tmp_path):
    address, env = ray_cluster
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, OWN_LOOP_ON_RAY, address, OWN_LOOP, OWN_LOOP_EPOCHS, str(out)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    said = proc.stdout + proc.stderr
    assert "rank 0 of 2, placed by ray" in said and "rank 1 of 2, placed by ray" in said
    assert "(world size 2)" in said
    final = torch.load(out / "final.pt", weights_only=True)
    assert_state_equal(final["model"], own_loop_launched[1]["model"])
