"""Lose a node, keep the run: 2 namespace nodes x 2 processes, `--nnodes 1:2 --global-batch-size
16`; node 2 is SIGKILLed (its agent and workers) mid-epoch. Node 1 continues alone and its final
model must be the uninterrupted run's (float64, SGD with momentum: only a wrong sample, batch or
state could move it by 1e-5)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, assert_state_close, load_model

pytestmark = pytest.mark.cluster

TASK = str(REPO / "tests" / "cluster" / "scripts" / "wine_float64_sgd.py") + ":build"
# 142 samples, 16 a step: 9 steps an epoch, the last one short
TRAIN = (
    TASK,
    "--epochs",
    "150",
    "--global-batch-size",
    "16",
    "--batch-size",
    "8",
    "--seed",
    "5",
    "--threads",
    "1",
    "--save-every",
    "0",
    "--save-every-steps",
    "120",
    "--eval-every",
    "1000",
)
K = 2  # steps between snapshots


def _start(net, run_dir: Path, endpoint: str, extra: list[str]):
    argv = [
        sys.executable,
        "-m",
        "ddpkit",
        "train",
        *TRAIN,
        "--nproc",
        "2",
        "--run-dir",
        str(run_dir),
        "--nnodes",
        "1:2",
        "--rdzv-endpoint",
        endpoint,
        "--max-restarts",
        "2",
        "--timeout",
        "30",
        *extra,
    ]
    logs = [open(run_dir.parent / f"node{i}.log", "w+") for i in (1, 2)]
    procs = [
        node.popen(argv, env={"PYTHONPATH": str(REPO / "src")}, stdout=log, stderr=subprocess.STDOUT, worker_env=False)
        for node, log in zip(net.nodes, logs, strict=True)
    ]
    return procs, logs


def _wait_epochs(run_dir: Path, n: int, procs, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    path = run_dir / "metrics.jsonl"
    while not (path.exists() and len(path.read_text().splitlines()) >= n):
        assert all(p.poll() is None for p in procs), "a node ended early"
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.02)


def test_a_lost_node_resumes_from_memory_and_ends_with_the_uninterrupted_model(two_nodes, tmp_path, reference_run):
    reference = load_model(reference_run(*TRAIN, "--nproc", "4", "--quiet"))
    run_dir = tmp_path / "run"
    endpoint = f"{two_nodes.nodes[0].ip}:{two_nodes.next_port()}"
    run_id = f"nodeloss-{tmp_path.name}"[:40]
    procs, logs = _start(two_nodes, run_dir, endpoint, ["--snapshot-every-steps", str(K), "--rdzv-id", run_id])
    try:
        _wait_epochs(run_dir, 15, procs)  # step 135: past the disk checkpoint of step 120, far from step 240
        two_nodes.nodes[1].kill_all()
        code = procs[0].wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs[0].seek(0)
    out = logs[0].read()
    print(out)
    assert code == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["nnodes"] == 1 and summary["epochs_done"] == 150, summary
    recovery = summary["recovery"]
    print("node loss:", recovery)
    assert recovery["resumed_from"] == "memory" and recovery["disk_checkpoint_step"] == 120, recovery
    assert recovery["resumed_step"] > 120 and recovery["resumed_step"] % K == 0, recovery
    assert 0 <= recovery["steps_redone"] <= K, recovery
    assert "ddpkit: recovered from a failure: resumed from memory" in out, out
    assert_state_close(load_model(run_dir), reference, rtol=1e-5, atol=1e-8)
    assert not list(Path("/dev/shm").glob(f"ddpkit-snapshots-{run_id}-*"))  # the survivor's and the lost node's
