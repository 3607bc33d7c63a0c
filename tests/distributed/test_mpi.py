"""The real mpirun (Debian's openmpi-bin): every MPI rank is one worker of one job, not N
independent single-process runs (issue 15)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import OWN_LOOP, OWN_LOOP_EPOCHS, REPO, assert_state_equal


@pytest.fixture(scope="module", autouse=True)
def open_mpi():
    """Debian's openmpi-bin, installed when missing and we are root (as CI is), like the
    cluster tests' SLURM; without root and without it, these tests skip, saying so."""
    if shutil.which("mpirun") is None and os.geteuid() == 0 and shutil.which("apt-get"):
        from cluster.netns import _apt_install

        _apt_install(["openmpi-bin"], timeout=600)
    if shutil.which("mpirun") is None:
        pytest.skip(
            "needs Open MPI's mpirun (apt-get install openmpi-bin, as root); the variables it sets are "
            "tested without it in tests/unit/environments/test_mpi_kubeflow.py"
        )


def mpirun(n: int, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    cmd = ["mpirun", *root, "--oversubscribe", "-np", str(n), "-x", "PYTHONPATH", *argv]
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": str(REPO / "src"), **(env or {})},
    )


def test_own_loop_under_mpirun_is_one_job_equal_to_ddpkit_launch(tmp_path, own_loop_launched):
    import sys

    proc = mpirun(2, sys.executable, OWN_LOOP, "--epochs", OWN_LOOP_EPOCHS, "--out", str(tmp_path / "mpi"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("epoch 3: loss") == 1 and "(world size 2)" in proc.stdout  # one job of 2, rank 0 prints
    a = torch.load(Path(tmp_path / "mpi" / "final.pt"), weights_only=True)["model"]
    assert_state_equal(a, own_loop_launched[1]["model"])  # ddpkit launch --nproc 2, the same epochs


def test_ddpkit_env_under_mpirun_names_mpi_and_each_rank():
    import sys

    proc = mpirun(2, sys.executable, "-m", "ddpkit", "env")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("detected    MPI (openmpi") == 2
    assert "rank 0, local rank 0" in proc.stdout and "rank 1, local rank 1" in proc.stdout


def test_ddpkit_train_under_mpirun_equals_its_own_two_processes(tmp_path, reference_run):
    import sys

    flags = ["--seed", "5", "--save-every", "2", "--epochs", "6", "--quiet"]  # test_fsdp's and test_export's DDP run
    proc = mpirun(2, sys.executable, "-m", "ddpkit", "train", *flags, "--run-dir", str(tmp_path / "mpi"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    own = reference_run("--nproc", "2", *flags)
    assert_state_equal(
        torch.load(tmp_path / "mpi" / "model.pt", weights_only=True),
        torch.load(own / "model.pt", weights_only=True),
    )
