"""Shared helpers: run the real CLI in a subprocess, with a timeout, and read its run dir."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # this checkout's ddpkit, whatever is installed


def run_ddpkit(
    *args: str, cwd: Path | str | None = None, timeout: float = 240, env: dict | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """`python -m ddpkit ARGS`; fails the test with the output if it exits non-zero (when check)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO / "src"), **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "ddpkit", *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        pytest.fail(f"ddpkit {' '.join(args)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def load_model(run_dir: Path | str) -> dict[str, torch.Tensor]:
    return torch.load(Path(run_dir) / "model.pt", weights_only=True)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def assert_state_close(a, b, rtol=1e-5, atol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def assert_state_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs (max abs diff {(a[k] - b[k]).abs().max().item():.3g})"


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """`reference_run(*ARGS)`: the run directory of `ddpkit train ARGS`, trained once per
    session for every test that asks for exactly these ARGS. A reference to compare with:
    read it, never resume or train into it (copy what a test changes)."""
    done: dict[tuple[str, ...], Path] = {}

    def run(*args: str) -> Path:
        if args not in done:
            run_dir = tmp_path_factory.mktemp("reference") / "run"
            run_ddpkit("train", *args, "--run-dir", str(run_dir))
            done[args] = run_dir
        return done[args]

    return run


OWN_LOOP = str(REPO / "examples" / "own_loop.py")
OWN_LOOP_EPOCHS = "3"


@pytest.fixture(scope="session")
def own_loop_launched(tmp_path_factory):
    """`ddpkit launch --nproc 2 examples/own_loop.py --epochs 3`, run once per session for every
    test that compares another launcher (torchrun, mpirun, Kubeflow's pods) with it: its
    stdout and its final.pt (loaded). Read them, never train into its folder."""
    out = tmp_path_factory.mktemp("own_loop") / "out"
    proc = run_ddpkit("launch", "--nproc", "2", OWN_LOOP, "--epochs", OWN_LOOP_EPOCHS, "--out", str(out))
    return proc.stdout, torch.load(out / "final.pt", weights_only=True)
