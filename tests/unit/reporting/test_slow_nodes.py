"""The record `ddpkit slurm --exclude-slow` acts on (reporting/slow_nodes.py): which SLURM node
each check of the straggler view named, and for how many checks in a row, across requeues."""

import json

from ddpkit.reporting.slow_nodes import Recorder, SlowNodes, named_nodes, slow_node_recorder
from ddpkit.util.envvars import SLOW_NODES_FILE_VAR

HOSTS = ["gpu01", "gpu02", "gpu03"]
NODES = [0, 0, 1, 1, 2, 2]  # each rank's node id (SLURM_NODEID)


def compute(rank, ratio=2.0):
    return {"rank": rank, "where": "compute", "ratio": ratio}


def link(node):
    return {"rank": 2 * node, "where": "link", "node": node, "ratio": 9.0, "ranks": [2 * node, 2 * node + 1]}


def test_a_check_names_the_nodes_of_the_ranks_it_names_by_slurm_name_with_the_worst_finding():
    found = [compute(2, 1.5), compute(3, 2.5), link(2), {**link(2), "rank": 5}]
    assert named_nodes(found, NODES, HOSTS) == {
        "gpu02": {"rank": 3, "where": "compute", "ratio": 2.5},
        "gpu03": {"rank": 4, "where": "link", "ratio": 9.0},
    }


def test_only_checks_in_a_row_up_to_the_latest_make_a_node_slow():
    record = SlowNodes()
    step = iter(range(100, 10000, 100))
    record.check({"gpu02": compute(2)}, next(step))
    assert record.slow() == [] and record.streak("gpu02") == 1  # once is not enough
    record.check({"gpu02": compute(2)}, next(step))
    assert record.slow() == ["gpu02"]
    record.check({}, next(step))  # a check that did not name it ends the streak
    assert record.slow() == [] and record.streak("gpu02") == 0
    record.check({"gpu02": compute(3)}, next(step))
    record.check({"gpu01": compute(0)}, next(step))
    record.check({"gpu03": compute(4)}, next(step))  # gpu01: named, then not
    record.check({"gpu01": compute(0), "gpu03": compute(4)}, next(step))
    assert record.slow() == ["gpu03"] and record.streak("gpu01") == 1
    for _ in range(2):
        record.check({"gpu01": compute(1), "gpu03": compute(4)}, next(step))
    assert record.slow() == ["gpu03", "gpu01"]  # the longest streak first
    assert (record.streak("gpu03"), record.streak("gpu01")) == (4, 3)
    assert record.why("gpu01") == "; ".join(
        f"step {s}: rank {r}, compute, 2.0x the median" for s, r in [(700, 0), (800, 1), (900, 1)]
    )


def test_the_record_is_rank_0s_file_and_its_checks_go_on_after_a_requeue(tmp_path):
    path = tmp_path / "slow-nodes.json"
    first = Recorder(str(path), HOSTS)
    first([link(1)], NODES, 10)
    saved = json.loads(path.read_text())
    assert saved["checks"] == 1 and saved["nodes"]["gpu02"]["named"] == [
        {"check": 1, "step": 10, "rank": 2, "where": "link", "ratio": 9.0}
    ]
    again = Recorder(str(path), ["gpu02", "gpu01", "gpu03"])  # the requeued job: other node ids
    again([compute(0)], NODES, 20)  # rank 0 is on gpu02 now
    record = SlowNodes.load(path)
    assert record.checks == 2 and record.slow() == ["gpu02"] and record.streak("gpu02") == 2
    for _ in range(8):
        again([compute(0)], NODES, 30)
    assert len(SlowNodes.load(path).nodes["gpu02"]["named"]) == 5  # the latest namings only


def test_the_recorder_is_made_on_rank_0_of_a_job_that_asks_and_only_where_the_names_agree(tmp_path, capsys):
    env = {
        SLOW_NODES_FILE_VAR: str(tmp_path / "slow-nodes.json"),
        "SLURM_JOB_NODELIST": "gpu[01-03]",
        "SLURMD_NODENAME": "gpu01",
    }
    made = slow_node_recorder(True, 0, env)
    assert isinstance(made, Recorder) and made.hosts == HOSTS
    assert slow_node_recorder(False, 0, env) is None  # other ranks
    assert slow_node_recorder(True, 0, {k: v for k, v in env.items() if k != SLOW_NODES_FILE_VAR}) is None
    assert capsys.readouterr().err == ""
    step_list = {**env, "SLURM_STEP_NODELIST": "gpu[02-03]", "SLURMD_NODENAME": "gpu02"}
    assert slow_node_recorder(True, 0, step_list).hosts == ["gpu02", "gpu03"]  # the step's node ids
    assert slow_node_recorder(True, 1, env) is None  # node 1 is gpu02, not this node: no record at all
    assert capsys.readouterr().err.strip() == (
        "ddpkit: warning: no slow-node record for --exclude-slow: node 1 of gpu01,gpu02,gpu03 is not this node, gpu01"
    )


def test_a_record_that_cannot_be_written_is_said_once_and_training_goes_on(tmp_path, capsys):
    recorder = Recorder(str(tmp_path / "missing" / "slow-nodes.json"), HOSTS)
    recorder([compute(0)], NODES, 5)
    recorder([compute(0)], NODES, 10)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddpkit: warning: no slow-node record for --exclude-slow (")
