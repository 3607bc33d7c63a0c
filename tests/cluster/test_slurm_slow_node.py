"""`ddpkit slurm --exclude-slow` on a real 3-node SLURM cluster: a job of 2 nodes runs on node1 and
node2, whose link is throttled (tbf), while node3 is drained; the straggler view names node2 at
check after check (RUN_DIR/slow-nodes.json). While node3 is out of service, leaving node2 out would
leave the partition too few nodes for the job, and the decision says so; once node3 is back, it
leaves node2 out. The time limit's warning signal then stops the job, the batch script requeues it
with ExcNodeList=node2, and the requeued job resumes on node1 and node3 to the end."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.slurm import _field, require_slurm, slurm_cluster
from conftest import REPO, run_ddpkit

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TASK = str(Path(__file__).parent / "scripts" / "wide_mlp.py") + ":build"
TRAIN = ["--epochs", "10", "--batch-size", "8", "--straggler-every", "2", "--threads", "1", "--save-every", "0"]
TRAIN += ["--progress", "lines", "--timeout", "60"]


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory):
    require_slurm()
    with slurm_cluster(tmp_path_factory.mktemp("slurm3"), prefix="ddpks3", subnet="10.213.78", nodes=3) as cluster:
        yield cluster


def _tc(node, *args):
    subprocess.run(["nsenter", f"--net={node.netns_path}", "tc", "qdisc", *args], check=True, timeout=20)


def _exclude_decision(cluster, env, record, job):
    """What the batch script's helper decides now, for the running job: (ExcNodeList, its log lines)."""
    proc = subprocess.run(
        [sys.executable, "-m", "ddpkit.engines.exclude_slow", str(record), str(job), "2"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc
    return proc.stdout.strip(), proc.stderr


def _streak(record, node):
    if not record.exists():
        return 0
    data = json.loads(record.read_text())
    entry = data["nodes"].get(node)
    return entry["streak"] if entry and entry["last_check"] == data["checks"] else 0


def test_a_node_named_slow_at_consecutive_checks_is_left_out_of_the_requeued_job(three_nodes, tmp_path):
    cl = three_nodes
    node2 = cl.nodes[1]
    env = {**cl.env, "PYTHONPATH": str(REPO / "src")}
    run_dir, record = tmp_path / "job", tmp_path / "job" / "slow-nodes.json"
    cl.scontrol("update", "NodeName=node3", "State=DRAIN", "Reason=ddpkit-test")
    _tc(node2, "add", "dev", node2.ifname, "root", "tbf", "rate", "30mbit", "burst", "32kbit", "latency", "400ms")
    try:
        proc = run_ddpkit(
            "slurm", "--nodes", "2", "--shared-run-dir", "--exclude-slow", "--submit",
            "--", TASK, *TRAIN, "--run-dir", str(run_dir), cwd=tmp_path, env=env, timeout=60,
        )  # fmt: skip
        job = int(proc.stdout.split("submitted job ")[1].split(";")[0])
        deadline = time.monotonic() + 120
        while _streak(record, "node2") < 2:  # named at 2 checks in a row
            state = cl.state(job)
            assert state.state in ("PENDING", "RUNNING") and time.monotonic() < deadline, cl.diagnostics(job)
            time.sleep(0.1)
        assert _field(cl.job_info(job), "NodeList") == "node[1-2]"
        # node3 drained: without node2 the partition would keep 1 usable node for a job of 2
        exclude, said = _exclude_decision(cl, env, record, job)
        assert exclude == "" and "ddpkit: node node2 stays in the job though named slow" in said, said
        assert "(debug: node1)" in said, said
        cl.scontrol("update", "NodeName=node3", "State=RESUME")
        while cl.sinfo("-h", "-n", "node3", "-o", "%T").strip() != "idle":  # "idle*" until it answers again
            assert time.monotonic() < deadline, cl.diagnostics(job)
            time.sleep(0.1)
        exclude, said = _exclude_decision(cl, env, record, job)
        assert exclude == "node2" and "ddpkit: the requeued job leaves out node node2" in said, said
        cl.signal(job, "USR2", scope="steps")  # the time limit's warning
        result = cl.wait(job, timeout=180)
    finally:
        _tc(node2, "del", "dev", node2.ifname, "root")
    log = next(run_dir.glob("slurm-*.out")).read_text()
    assert result.state == "COMPLETED" and result.restarts == 1, (result, log)
    assert _field(result.raw, "ExcNodeList") == "node2", result.raw
    assert result.node_list == "node[1,3]", result.raw  # where the requeued job ran
    said = [line for line in log.splitlines() if "leaves out node node2" in line]
    assert len(said) == 1 and "named slow at the last" in said[0] and "link" in said[0], log
    assert "ddpkit: requeueing SLURM job" in log and "ddpkit: resuming from" in log, log
    epochs = [json.loads(x)["epoch"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert epochs == list(range(1, 11)), epochs
    data = json.loads(record.read_text())  # the requeued run's checks went on without node2
    assert data["nodes"]["node2"]["last_check"] < data["checks"], data
