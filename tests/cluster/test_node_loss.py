"""Lose a node, keep the run: 2 namespace nodes x 2 processes, `--nnodes 1:2 --global-batch-size
16`. Node 2 is SIGKILLed (its agent and workers) mid-epoch: node 1 resumes from the snapshot in
its memory and continues alone. Or node 2 joins a running job: it is admitted at a restart. Or
node 1's agent stalls while node 2 joins: the rendezvous drops node 1 and node 2 trains alone (a
split brain) until node 1's world finds the run directory taken, stops and rejoins. Every way
the final model must be the uninterrupted 4-process run's (float64, SGD with momentum: only a
wrong sample, batch or state could move it by 1e-5). The lost node for DDP (local rank 0 keeps
its node's replica) and HSDP (one replica group per node, every rank keeps its own shards: the
survivors resume from their own; a joining node's ranks receive theirs from a peer)."""

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import REPO, assert_state_close, load_model

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TASK = str(REPO / "tests" / "cluster" / "scripts" / "wine_float64_sgd.py") + ":build"
# 142 samples, 16 a step: 9 steps an epoch, the last one short; a disk checkpoint every 120 steps
TRAIN = (TASK, "--epochs", "40", "--global-batch-size", "16", "--batch-size", "8", "--seed", "5", "--threads", "1")
TRAIN += ("--save-every", "0", "--save-every-steps", "120", "--eval-every", "1000")
K = 2  # steps between snapshots


def _start(node, run_dir: Path, endpoint: str, run_id: str, log_name: str, *extra: str, env=None):
    argv = [sys.executable, "-m", "ddpkit", "train", *TRAIN, "--nproc", "2", "--run-dir", str(run_dir)]
    argv += ["--nnodes", "1:2", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--max-restarts", "2"]
    argv += ["--timeout", "30", "--snapshot-every-steps", str(K), *extra]
    log = open(run_dir.parent / log_name, "w+")
    env = {"PYTHONPATH": str(REPO / "src"), **(env or {})}
    return node.popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, worker_env=False), log


def _wait_epochs(run_dir: Path, n: int, procs, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    path = run_dir / "metrics.jsonl"
    while not (path.exists() and len(path.read_text().splitlines()) >= n):
        assert all(p.poll() is None for p in procs), "a node ended early"
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.02)


def _finish(procs, logs, timeout: float = 120):
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outs = []
    for log in logs:
        log.seek(0)
        outs.append(log.read())
    return codes, outs


def _snapshots_left(run_id: str) -> list[Path]:
    return list(Path("/dev/shm").glob(f"ddpkit-snapshots-{run_id}-*"))


STRATEGIES = pytest.mark.parametrize("strategy", ["ddp", "hsdp"])


@STRATEGIES
def test_a_lost_node_resumes_from_memory_and_ends_with_the_uninterrupted_model(
    two_nodes, tmp_path, reference_run, strategy
):
    reference = load_model(reference_run(*TRAIN, "--nproc", "4", "--quiet"))
    run_dir, run_id = tmp_path / "run", f"lost-{tmp_path.name}"[:40]
    endpoint = f"{two_nodes.nodes[0].ip}:{two_nodes.next_port()}"
    started = [
        _start(node, run_dir, endpoint, run_id, f"node{i}.log", "--strategy", strategy)
        for i, node in enumerate(two_nodes.nodes)
    ]
    procs, logs = [p for p, _ in started], [log for _, log in started]
    try:
        _wait_epochs(run_dir, 15, procs)  # step 135: past the disk checkpoint of step 120, far from step 240
    finally:
        two_nodes.nodes[1].kill_all()
    (code, _), (out, _) = _finish(procs, logs)
    assert code == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["nnodes"] == 1 and summary["epochs_done"] == 40, summary
    recovery = summary["recovery"]
    print("node loss:", recovery)
    assert recovery["resumed_from"] == "memory" and recovery["disk_checkpoint_step"] == 120, recovery
    assert recovery["resumed_step"] > 120 and recovery["resumed_step"] % K == 0, recovery
    assert 0 <= recovery["steps_redone"] <= K, recovery
    assert "ddpkit: recovered from a failure: resumed from memory" in out, out
    assert_state_close(load_model(run_dir), reference, rtol=1e-5, atol=1e-8)
    assert not _snapshots_left(run_id)  # the survivor's, and the lost node's


# HSDP only: the join itself is the same for DDP, and DDP's way of handing the snapshot over (a
# broadcast from the lowest rank holding it) is the lost-node test's too; HSDP's joining ranks
# receive their shards point to point, which nothing else exercises
@pytest.mark.parametrize("strategy", ["hsdp"])
def test_a_node_that_joins_a_running_job_is_admitted_and_the_model_is_the_same(
    two_nodes, tmp_path, reference_run, strategy
):
    reference = load_model(reference_run(*TRAIN, "--nproc", "4", "--quiet"))
    run_dir, run_id = tmp_path / "run", f"join-{tmp_path.name}"[:40]
    endpoint = f"{two_nodes.nodes[0].ip}:{two_nodes.next_port()}"
    # node 1 alone (world 2), slowed to 60 ms a step so that it is still training when node 2 has started
    first, first_log = _start(
        two_nodes.nodes[0],
        run_dir,
        endpoint,
        run_id,
        "node1.log",
        "--strategy",
        strategy,
        env={"WINE_STEP_SLEEP_S": "0.06"},
    )
    try:
        _wait_epochs(run_dir, 1, [first])
        # a joining node continues the run (its run directory already holds one); node 1's
        # workers, restarted by torch to admit it, are told of no restart: they resume all the same
        second, second_log = _start(
            two_nodes.nodes[1], run_dir, endpoint, run_id, "node2.log", "--auto-resume", "--strategy", strategy
        )
    except BaseException:
        first.kill()
        raise
    codes, outs = _finish([first, second], [first_log, second_log])
    assert codes == [0, 0], "\n\n".join(outs)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["nnodes"] == 2 and summary["epochs_done"] == 40, summary
    recovery = summary["recovery"]
    print("node joined:", recovery)
    assert recovery["resumed_from"] == "memory" and recovery["resumed_step"] >= 9, recovery  # not from scratch
    assert_state_close(load_model(run_dir), reference, rtol=1e-5, atol=1e-8)
    assert not _snapshots_left(run_id)


def test_a_node_dropped_by_the_rendezvous_stops_when_the_other_world_takes_the_run_dir_and_rejoins(
    two_nodes, tmp_path, reference_run
):
    reference = load_model(reference_run(*TRAIN, "--nproc", "4", "--quiet"))
    run_dir, run_id = tmp_path / "run", f"split-{tmp_path.name}"[:40]
    # the rendezvous store outside both nodes: it keeps serving while node 1's launcher is stopped
    port = two_nodes.next_port()
    store = dist.TCPStore(
        two_nodes.bridge_ip, port, None, True, timedelta(seconds=60), wait_for_workers=False, multi_tenant=True
    )
    endpoint = f"{two_nodes.bridge_ip}:{port}"
    paced = {"WINE_STEP_SLEEP_S": "0.06"}  # both still training when node 1 rejoins
    first, first_log = _start(two_nodes.nodes[0], run_dir, endpoint, run_id, "node1.log", env=paced)
    try:
        _wait_epochs(run_dir, 1, [first])
        mark = (run_dir / ".world").read_text()
        os.kill(first.pid, signal.SIGSTOP)  # an overloaded agent: no keep-alive; its workers train on
        try:
            second, second_log = _start(
                two_nodes.nodes[1], run_dir, endpoint, run_id, "node2.log", "--auto-resume", env=paced
            )
            deadline = time.monotonic() + 60
            while (run_dir / ".world").read_text() == mark:  # node 2 dropped node 1 and started a world alone
                assert second.poll() is None and time.monotonic() < deadline, "node 2 formed no world of its own"
                time.sleep(0.05)
        finally:
            os.kill(first.pid, signal.SIGCONT)
    except BaseException:
        first.kill()
        raise
    codes, outs = _finish([first, second], [first_log, second_log])
    del store
    out = outs[0]
    assert codes == [0, 0], "\n\n".join(outs)
    assert "ddpkit: warning: another world took over the run directory" in out, out
    assert "restarting this node's workers" in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["nnodes"] == 2 and summary["epochs_done"] == 40, summary
    assert not (run_dir / "failed.json").exists()
    assert_state_close(load_model(run_dir), reference, rtol=1e-5, atol=1e-8)
    assert not _snapshots_left(run_id)
