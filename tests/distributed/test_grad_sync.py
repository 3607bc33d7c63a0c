"""--grad-sync: gradients all-reduced through shared memory (the default for CPU ranks on one
machine) give the same model as gloo's all-reduce, leave nothing in /dev/shm, and are refused
where they cannot apply."""

import json
import os

import pytest

from conftest import REPO, assert_state_close, assert_state_equal, load_model, run_ddpkit

COMMON = ["--epochs", "3", "--save-every", "0", "--eval-every", "3", "--quiet", "--seed", "0", "--batch-size", "16"]
SHM = "/dev/shm"


def _ours():
    return {f for f in os.listdir(SHM) if f.startswith("ddpkit-grad-")} if os.path.isdir(SHM) else set()


def _train(tmp_path, name, *flags):
    run = tmp_path / name
    run_ddpkit("train", *COMMON, *flags, "--run-dir", str(run), cwd=tmp_path)
    return run, json.loads((run / "summary.json").read_text())


@pytest.mark.parametrize("nproc", [2, 3])
def test_shm_gives_the_model_gloo_gives(tmp_path, nproc):
    before = _ours()
    shm, s_shm = _train(tmp_path, "shm", "--nproc", str(nproc))  # the default: auto -> shm here
    gloo, s_gloo = _train(tmp_path, "gloo", "--nproc", str(nproc), "--grad-sync", "backend")
    assert (s_shm["grad_sync"], s_gloo["grad_sync"]) == ("shm", "gloo")
    if nproc == 2:
        assert_state_equal(load_model(shm), load_model(gloo))  # x/2 + y/2: the same sum bit for bit
    else:
        assert_state_close(load_model(shm), load_model(gloo), rtol=1e-5, atol=1e-6)  # another summation order
    assert s_shm["train_loss"] == pytest.approx(s_gloo["train_loss"], rel=1e-5)
    assert _ours() <= before, f"left in {SHM}: {_ours() - before}"


@pytest.mark.parametrize("nproc", [2, 3])
def test_shm_all_reduce_against_gloo_in_chunks(tmp_path, nproc):
    # chunks of 7 elements around sizes 1..1000, replicas bit-identical, float64 through the
    # backend, and a full /dev/shm: refused with `shm`, a fallback with a message with `auto`
    proc = run_ddpkit(
        "launch", "--nproc", str(nproc), str(REPO / "tests/distributed/scripts/shm_allreduce_check.py"), cwd=tmp_path
    )
    assert f"SHM OK {nproc}" in proc.stdout


def test_shm_with_accumulation_and_resume(tmp_path):
    # no_sync micro-batches skip the hook; a resumed run builds a fresh mapping: same model as gloo
    flags = ["--nproc", "2", "--batch-size", "8", "--accumulate", "2", "--seed", "0", "--quiet", "--eval-every", "3"]
    gloo = tmp_path / "gloo"
    run_ddpkit(
        "train",
        *flags,
        "--epochs",
        "3",
        "--save-every",
        "0",
        "--grad-sync",
        "backend",
        "--run-dir",
        str(gloo),
        cwd=tmp_path,
    )
    part = tmp_path / "part"
    run_ddpkit("train", *flags, "--epochs", "2", "--save-every", "1", "--run-dir", str(part), cwd=tmp_path)
    run_ddpkit("train", *flags, "--epochs", "3", "--save-every", "1", "--run-dir", str(part), "--resume", cwd=tmp_path)
    assert json.loads((part / "summary.json").read_text())["grad_sync"] == "shm"
    assert_state_equal(load_model(part), load_model(gloo))


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--grad-sync", "shm", "--grad-compression", "bf16"], "cannot carry --grad-compression bf16"),
        (["--grad-sync", "shm", "--strategy", "fsdp"], "--grad-sync shm: DDP options"),
        (["--grad-sync", "tcp"], "invalid choice"),
    ],
)
def test_grad_sync_refusals(tmp_path, flags, fragment):
    proc = run_ddpkit(
        "train", "--nproc", "2", "--epochs", "1", "--run-dir", str(tmp_path / "r"), *flags, cwd=tmp_path, check=False
    )
    assert proc.returncode == 2, proc.stderr
    assert fragment in proc.stderr
    assert "Traceback" not in proc.stderr
