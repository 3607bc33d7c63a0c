"""`ddpkit check` for real on this machine: 2 workers pass with a real all-reduce; a rank
that runs another torch (a second venv) is named and fails the check."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, run_ddpkit

# A Python with another torch than this checkout's, e.g. a venv made with
#   python3 -m venv /tmp/venv-torch214 && /tmp/venv-torch214/bin/pip install torch==2.14.1 numpy
OTHER_TORCH = os.environ.get("DDPKIT_OTHER_TORCH_PYTHON")


def test_ddpkit_check_on_one_node_passes_with_a_real_all_reduce(tmp_path):
    proc = run_ddpkit("check", "--nproc", "2", "--run-dir", str(tmp_path / "runs"), timeout=120)
    lines = proc.stdout.splitlines()
    assert lines[0] == "ddpkit check: 2 rank(s) on 1 node(s)", proc.stdout
    for row in (
        "versions       OK",
        "backend        OK    gloo",
        "run directory  OK",
        "all-reduce     OK    all 2 ranks",
    ):
        assert any(line.strip().startswith(row.strip()) for line in lines), (row, proc.stdout)
    assert lines[-1].startswith("verdict: a job would run here"), proc.stdout
    assert not any(p.name.startswith(".ddpkit-check") for p in (tmp_path / "runs").iterdir())  # cleaned up


@pytest.mark.skipif(
    not OTHER_TORCH,
    reason="needs DDPKIT_OTHER_TORCH_PYTHON: a Python whose torch differs from this "
    "checkout's (see the comment at the top of this file)",
)
def test_a_rank_with_another_torch_is_named_and_fails_the_check(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "src"),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0",
    }
    procs = [
        subprocess.Popen(
            [python, "-m", "ddpkit", "check", "--run-dir", str(tmp_path), "--timeout", "60"],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r, python in enumerate((sys.executable, OTHER_TORCH))
    ]  # torchrun's environment, two torches
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [1, 1], outs
    versions = next(line for line in outs[0].splitlines() if line.strip().startswith("versions"))
    assert "FAIL" in versions and f"torch {torch.__version__} on rank 0 (" in versions and "on rank 1 (" in versions, (
        outs
    )
    assert "not run: the ranks run different versions" in outs[0] and "verdict: a job would NOT run here" in outs[0]
