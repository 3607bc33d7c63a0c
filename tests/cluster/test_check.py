"""`ddpkit check` on two real "nodes" (network namespaces, own hostnames): a healthy pair
passes with a measured node-pair all-reduce; a node whose run directory is another folder
(a bind mount in its mount namespace) and a node with another torch (a second venv) fail
the check, each named."""

import os
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.cluster

# A Python with another torch than this checkout's, e.g. a venv made with
#   python3 -m venv /tmp/venv-torch214 && /tmp/venv-torch214/bin/pip install torch==2.14.1 numpy
OTHER_TORCH = os.environ.get("DDPKIT_OTHER_TORCH_PYTHON")


def _check(net, tmp_path, node2_prefix=(), node2_python=sys.executable, run_dir=None):
    run_dir = run_dir or tmp_path / "run"
    port = str(net.next_port())
    n1, n2 = net.nodes[0], net.nodes[1]

    def argv(python, rank):
        return [
            python,
            "-m",
            "ddpkit",
            "check",
            "--nproc",
            "1",
            "--nnodes",
            "2",
            "--master-addr",
            n1.ip,
            "--master-port",
            port,
            "--node-rank",
            str(rank),
            "--run-dir",
            str(run_dir),
            "--timeout",
            "60",
        ]

    results = net.run_all(
        [(n1, argv(sys.executable, 0)), (n2, [*node2_prefix, *argv(node2_python, 1)])],
        timeout=150,
        env={"PYTHONPATH": str(REPO / "src")},
        worker_env=False,
        uts=True,
        fail_grace=None,
    )
    logs = "\n\n".join(f"--- {r.node.name} rc={r.returncode} timed_out={r.timed_out}\n{r.output}" for r in results)
    assert not any(r.timed_out for r in results), logs
    return results, logs


def _row(output, name):
    return next(line for line in output.splitlines() if line.strip().startswith(name + " "))


def test_check_on_two_nodes_passes_with_a_node_pair_all_reduce(two_nodes, tmp_path):
    results, logs = _check(two_nodes, tmp_path)
    out = results[0].output
    assert all(r.returncode == 0 for r in results), logs
    assert "ddpkit check: 2 rank(s) on 2 node(s)" in out, logs
    assert "OK" in _row(out, "ports") and "every node reached a fresh TCP port" in out, logs
    assert "node1 (node 0) <-> node2 (node 1): latency" in out, logs
    assert "gloo via eth0" in _row(out, "backend"), logs
    assert out.strip().splitlines()[-1].startswith("verdict: a job would run here"), logs


def test_check_names_a_node_whose_run_directory_is_another_folder(two_nodes, tmp_path):
    shared, other = tmp_path / "run", tmp_path / "elsewhere"
    shared.mkdir()
    other.mkdir()
    bind = [
        "unshare",
        "--mount",
        "--",
        "sh",
        "-c",
        'mount --bind "$0" "$1" && shift && exec "$@"',
        str(other),
        str(shared),
    ]
    results, logs = _check(two_nodes, tmp_path, node2_prefix=bind, run_dir=shared)
    out = results[0].output
    assert results[0].returncode == 1 and results[1].returncode == 1, logs
    row = _row(out, "run directory")
    assert "FAIL" in row and "is not one shared folder" in row, logs
    assert "rank 1 (node2) sees the files of rank(s) 1" in row and "a different folder on node2 (node 1)" in row, logs
    assert "verdict: a job would NOT run here: run directory failed" in out, logs


@pytest.mark.skipif(
    not OTHER_TORCH,
    reason="needs DDPKIT_OTHER_TORCH_PYTHON: a Python whose torch differs from this "
    "checkout's (see the comment at the top of this file)",
)
def test_check_names_a_node_with_another_torch(two_nodes, tmp_path):
    results, logs = _check(two_nodes, tmp_path, node2_python=OTHER_TORCH)
    out = results[0].output
    assert results[0].returncode == 1 and results[1].returncode == 1, logs
    row = _row(out, "versions")
    import torch

    assert "FAIL" in row and f"torch {torch.__version__} on rank 0 (node1) vs " in row and "on rank 1 (node2)" in row, (
        logs
    )
    assert "not run: the ranks run different versions" in _row(out, "all-reduce"), logs


def test_a_rank_sleeping_on_node_2_is_named_by_node_1(two_nodes, tmp_path):
    """Two nodes, one shared run directory: rank 1 (node2) sleeps inside a step; node1's
    launcher prints the summary with node2's stack line."""
    tasks = REPO / "tests" / "distributed" / "scripts" / "fault_tasks.py"
    run_dir = tmp_path / "run"
    port = str(two_nodes.next_port())
    n1, n2 = two_nodes.nodes[0], two_nodes.nodes[1]

    def argv(rank):
        return [
            sys.executable,
            "-m",
            "ddpkit",
            "train",
            f"{tasks}:exits_midway",
            "--nproc",
            "1",
            "--nnodes",
            "2",
            "--master-addr",
            n1.ip,
            "--master-port",
            port,
            "--node-rank",
            str(rank),
            "--run-dir",
            str(run_dir),
            "--epochs",
            "40",
            "--batch-size",
            "16",
            "--quiet",
            "--hang-timeout",
            "3",
            "--timeout",
            "60",
        ]

    results = two_nodes.run_all(
        [(n1, argv(0)), (n2, argv(1))],
        timeout=150,
        uts=True,
        worker_env=False,
        fail_grace=30,
        env={"PYTHONPATH": str(REPO / "src"), "FAULT_STEP": "7", "FAULT_RANK": "1", "FAULT_HANG": "1"},
    )
    logs = "\n\n".join(f"--- {r.node.name} rc={r.returncode} timed_out={r.timed_out}\n{r.output}" for r in results)
    out = results[0].output
    assert results[0].returncode == 1, logs  # a hang is a failure, not a usage error
    assert "ddpkit: hang report" in out and "rank 1   [node2] in no collective" in out, logs
    sleep = next(i for i, line in enumerate(tasks.read_text().splitlines(), 1) if "time.sleep(600)" in line)
    assert "rank(s) 1 never arrived" in out and f"fault_tasks.py:{sleep} in forward" in out, logs
    error = next(line for line in out.splitlines() if line.startswith("ddpkit: error:"))
    assert "made no progress for" in error, logs  # node1's own line names the hang (either rank's), not a lost peer
    assert (run_dir / "hang" / "rank-1.txt").exists() and (run_dir / "hang" / "rank-0.txt").exists(), logs
