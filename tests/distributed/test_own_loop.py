"""Own-loop parity (issue 15): rt.wrap(strategy=, precision=), rt.accumulate, rt.clip_grad_norm,
rt.save / rt.load of plain, DDP and FSDP models train the same model as `ddpkit train` for
the same task, under `ddpkit launch` and under plain torchrun."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, assert_state_close, run_ddpkit
from ddpkit.strategies.precision import cpu_has_bf16

SCRIPT = str(Path(__file__).parent / "scripts" / "own_loop_parity.py")
TRAIN = ("--nproc", "2", "--epochs", "2", "--batch-size", "16", "--save-every", "0", "--quiet")


@pytest.fixture(scope="module")
def train_fsdp(tmp_path_factory):
    run = tmp_path_factory.mktemp("train") / "fsdp"
    run_ddpkit(
        "train", f"{SCRIPT}:build", *TRAIN, "--strategy", "fsdp", "--clip-grad-norm", "0.5", "--run-dir", str(run)
    )
    return torch.load(run / "model.pt", weights_only=True)


def _saved(out: Path) -> dict:
    return torch.load(out / "final.pt", weights_only=True)["model"]  # plain tensors: weights_only loads it


def test_own_loop_fsdp_with_accumulation_and_clipping_equals_ddpkit_train(tmp_path, train_fsdp):
    proc = run_ddpkit(
        "launch",
        "--nproc",
        "2",
        SCRIPT,
        "--strategy",
        "fsdp",
        "--accumulate",
        "2",
        "--clip",
        "0.5",
        "--out",
        str(tmp_path),
    )
    assert proc.stdout.count("reload ok") == 1  # whole and sharded saves loaded back, into FSDP and a plain model
    assert_state_close(_saved(tmp_path), train_fsdp, rtol=0, atol=1e-6)  # accumulation: another summation order
    assert (tmp_path / "final-sharded" / ".metadata").is_file()


def _torchrun(*argv: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT, *argv],
        check=True,
        capture_output=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
    )


def test_torchs_own_fully_shard_after_init_under_plain_torchrun_saves_whole_and_trains_the_same(tmp_path, train_fsdp):
    _torchrun("--own-fully-shard", "--clip", "0.5", "--out", str(tmp_path))  # the case, as a user runs it
    saved = _saved(tmp_path)
    assert all(type(t) is torch.Tensor for t in saved.values())  # not rank 0's half as DTensors
    assert_state_close(saved, train_fsdp, rtol=0, atol=1e-6)
    plain = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2)
    )
    plain.load_state_dict(saved)


def _own_loop_equals_ddpkit_train(tmp_path, precision):
    _torchrun("--precision", precision, "--out", str(tmp_path / "own"))
    run_ddpkit("train", f"{SCRIPT}:build", *TRAIN, "--precision", precision, "--run-dir", str(tmp_path / "train"))
    assert_state_close(
        _saved(tmp_path / "own"), torch.load(tmp_path / "train" / "model.pt", weights_only=True), rtol=0, atol=1e-6
    )


def test_own_loop_ddp_under_plain_torchrun_equals_ddpkit_train(tmp_path):
    _own_loop_equals_ddpkit_train(tmp_path, "fp32")


# Where the CPU lacks native bfloat16, rt.wrap(precision="bf16") refuses: tests/unit/test_session.py
# (test_bf16_on_a_cpu_without_native_bfloat16_is_refused) checks that on every CPU.
@pytest.mark.skipif(
    not cpu_has_bf16(),
    reason="needs a CPU with native bfloat16 (AVX512-BF16 or AMX); this one has "
    "neither, so ddpkit refuses bf16 here (test_session.py checks the refusal)",
)
def test_own_loop_ddp_bf16_under_plain_torchrun_equals_ddpkit_train(tmp_path):
    _own_loop_equals_ddpkit_train(tmp_path, "bf16")
