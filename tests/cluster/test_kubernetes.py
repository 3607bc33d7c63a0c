"""Kubeflow Trainer v2 pods played by the network-namespace nodes: each node runs the container
command of the TrainJob `ddpkit k8s` writes, with the environment Trainer's torch runtime gives
every pod (PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR as the DNS name of the
first pod, PET_MASTER_PORT). One process per pod, 2 pods: the arithmetic of a local 2-process run
through gloo (`--grad-sync backend`, 1 thread), so a resumed job ends at its model bit for bit.

Eviction is what the kubelet does: SIGTERM to the container's main process (`ddpkit train`), the
grace period, then SIGKILL. The job must save at the next step on EVERY pod, every pod must exit
with 143 (a failure, so the JobSet restarts the job), and the restarted pods resume from that
checkpoint."""

import json
import subprocess
import sys
import time

import pytest
import yaml

from conftest import REPO, assert_state_equal, load_model, run_ddpkit

pytestmark = pytest.mark.cluster

TASK = str(REPO / "tests" / "cluster" / "scripts" / "preempted_wine.py") + ":build"
# the job of test_slurm_preemption.py: the same local reference serves both
TRAIN = ["--epochs", "40", "--batch-size", "16", "--seed", "9", "--save-every", "0", "--eval-every", "20"]
TRAIN += ["--threads", "1"]
EXITED_BY_TERM = 128 + 15


@pytest.fixture
def reference(reference_run):
    return reference_run("wine", "--nproc", "2", "--quiet", "--grad-sync", "backend", *TRAIN)


def _pod_command(run_dir, *train_args):
    """The container command of the TrainJob `ddpkit k8s` writes for this job (the run directory
    on the shared volume), with this machine's Python for the image's."""
    volume = run_dir.parent
    proc = run_ddpkit(
        "k8s", "--nodes", "2", "--image", "ddpkit:test", "--volume", f"shared:{volume}",
        "--run-dir", str(run_dir), "--job-name", "wine", "--dry-run", "--", TASK, *train_args,
    )  # fmt: skip
    runtime, job = yaml.safe_load_all(proc.stdout)
    command = job["spec"]["trainer"]["command"]
    assert command[:4] == ["python", "-m", "ddpkit", "train"] and job["spec"]["trainer"]["numProcPerNode"] == 1
    return [sys.executable, *command[1:]]


def _pod_env(net, rank, port):
    """What Trainer v2's torch runtime sets in pod `rank` of a 2-node TrainJob (node1 is pod 0:
    its name resolves on every node, as the headless service's DNS name does in the cluster)."""
    return {
        "PYTHONPATH": str(REPO / "src"),
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "1",
        "PET_NODE_RANK": str(rank),
        "PET_MASTER_ADDR": net.nodes[0].name,
        "PET_MASTER_PORT": str(port),
    }


def _start_pods(net, tmp_path, command, name):
    port = net.next_port()
    logs = [open(tmp_path / f"{name}-pod{i}.log", "w+") for i in range(2)]
    procs = [
        node.popen(
            command, env=_pod_env(net, i, port), stdout=log, stderr=subprocess.STDOUT, uts=True, worker_env=False
        )
        for i, (node, log) in enumerate(zip(net.nodes, logs, strict=True))
    ]
    return procs, logs


def _finish(procs, logs, timeout):
    """Each pod's exit code and log; a pod still running after `timeout` s is a hang (killed)."""
    codes = []
    try:
        for p in procs:
            try:
                codes.append(p.wait(timeout=timeout))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    out = []
    for log in logs:
        log.seek(0)
        out.append(log.read())
        log.close()
    return codes, out


def _wait_training(run_dir, procs, timeout=120):
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()):
        assert all(p.poll() is None for p in procs), "a pod ended before training"
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.1)


def _evict_and_restart(net, tmp_path, reference, evicted):
    """Train slowly, SIGTERM the `ddpkit train` of the pods `evicted`, check that every pod saved
    at the same step and exited 143; then restart both pods (the JobSet's restart) and check the
    resumed job ends at the reference's model with every epoch logged once."""
    run_dir = tmp_path / "shared-volume" / "run"
    command = _pod_command(run_dir, "--task-arg", "slow=0.02", *TRAIN)
    procs, logs = _start_pods(net, tmp_path, command, "first")
    _wait_training(run_dir, procs)
    for i in evicted:
        procs[i].send_signal(15)
    # 60 s: the save and the stop take a few; torch's agent would wait 300 s in its exit barrier
    codes, outs = _finish(procs, logs, timeout=60)
    both = "\n\n".join(f"--- pod {i} exit {c}\n{o}" for i, (c, o) in enumerate(zip(codes, outs, strict=True)))
    assert codes == [EXITED_BY_TERM, EXITED_BY_TERM], both
    saved = [p.name for p in (run_dir / "checkpoints").iterdir()]
    assert len(saved) == 1, saved  # --save-every 0: the checkpoint of the eviction, on every pod alike
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_early"] and summary["stop_signal"] == "SIGTERM", summary
    step = summary["steps_done"]
    for out in outs:  # every pod says what was saved, at the one step every rank stopped at
        assert f"after saving a checkpoint at step {step}" in out, both
        assert "nothing newer was saved" not in out, both
    procs, logs = _start_pods(net, tmp_path, command, "restarted")  # a restarted pod runs what it ran before
    codes, outs = _finish(procs, logs, timeout=150)
    assert codes == [0, 0], outs
    assert f"ddpkit: resuming from {run_dir / 'checkpoints' / saved[0]}" in outs[0], outs[0]
    assert_state_equal(load_model(run_dir), load_model(reference))
    epochs = [json.loads(x)["epoch"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert epochs == list(range(1, 41)), epochs  # no epoch lost or logged twice


@pytest.mark.slow
def test_one_evicted_pod_stops_every_pod_at_one_saved_step_and_the_restarted_job_resumes_exactly(
    two_nodes, tmp_path, reference
):
    # A node drained or a pod preempted: only that pod gets SIGTERM. The other pod's ranks stop at
    # the same step (the step's agreement), and its `ddpkit train` exits 143 too, at once
    _evict_and_restart(two_nodes, tmp_path, reference, evicted=[1])


def test_the_environment_trainer_v2_sets_in_each_pod_trains_like_one_node(two_nodes, tmp_path, reference):
    run_dir = tmp_path / "shared-volume" / "run"
    procs, logs = _start_pods(two_nodes, tmp_path, _pod_command(run_dir, *TRAIN), "pods")
    codes, outs = _finish(procs, logs, timeout=150)
    assert codes == [0, 0], outs
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["world_size"], summary["nnodes"], summary["stopped_early"]) == (2, 2, False), summary
    assert "world size   2 (2 nodes)" in outs[0] and "train_loss" not in outs[1], outs  # pod 0 holds rank 0
    assert_state_equal(load_model(run_dir), load_model(reference))  # 2 ranks through gloo: the same sums


@pytest.mark.slow
def test_every_pod_evicted_saves_once_and_the_restarted_job_resumes_exactly(two_nodes, tmp_path, reference):
    # The TrainJob deleted, or every node drained at once: every pod gets SIGTERM
    _evict_and_restart(two_nodes, tmp_path, reference, evicted=[0, 1])
