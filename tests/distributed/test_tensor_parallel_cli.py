"""`ddpkit train --tp 2` on 4 processes, through the real CLI: a 2x2 (dp_shard, tp) mesh (FSDP) and a
(dp_replicate, tp) one (HSDP), the Linears split over the tp ranks and their pieces sharded over the
dp ranks, train the nanoGPT-shaped model of separate q/k/v (float64, SGD, gradient clipping active)
to the one-process model, with the same eval loss (each eval sample counted once) and the same
clipped norm. What is not built is refused before any worker starts, one line, exit 2."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from conftest import REPO, load_model, run_ddpkit

TASK = str(REPO / "tests" / "distributed" / "scripts" / "tp_task.py") + ":build"
# 3 steps of a global batch of 8; clipping at 0.5 acts on every step (norms 0.83 to 0.94)
COMMON = ["--epochs", "2", "--max-steps", "3", "--seed", "7", "--threads", "1", "--quiet", "--save-every", "0"]
COMMON += ["--batch-size", "4", "--global-batch-size", "8", "--clip-grad-norm", "0.5"]


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.parametrize(
    "mesh",
    [
        ("--strategy", "fsdp"),  # (dp_shard 2, tp 2)
        # (dp_replicate 2, dp_shard 1, tp 2): fully_shard over the 2-D dp sub-mesh of a 3-D mesh, the
        # replicas' gradients all-reduced (4 processes cannot hold all three dims > 1)
        ("--strategy", "hsdp", "--replicate", "2"),
    ],
    ids=["fsdp-x-tp", "hsdp-x-tp"],
)
def test_tp_2_on_4_processes_trains_what_one_process_trains(reference_run, tmp_path, mesh):
    one = reference_run(TASK, "--nproc", "1", *COMMON)
    run = tmp_path / "split"
    run_ddpkit("train", TASK, "--nproc", "4", "--tp", "2", *mesh, *COMMON, "--run-dir", str(run))
    whole, ref = load_model(run), load_model(one)  # model.pt: the whole, unsplit weights
    assert whole.keys() == ref.keys()
    for name, weight in ref.items():
        assert whole[name].shape == weight.shape, name
        assert torch.allclose(whole[name], weight, atol=1e-12, rtol=0), name
    split, single = _records(run), _records(one)
    assert [r["step"] for r in split] == [r["step"] for r in single]
    for a, b in zip(split, single, strict=True):
        assert abs(a["eval_loss"] - b["eval_loss"]) < 1e-12  # 10 eval samples, each counted once
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-12  # the global norm over both meshes
        assert a["grad_norm"] > 0.5  # so clipping changed every step
    sys.path.insert(0, str(REPO / "tests" / "unit" / "strategies"))
    from test_tensor_parallel_plan import Gpt

    torch.manual_seed(0)
    start = Gpt().double().state_dict()
    assert max((ref[k] - start[k]).abs().max().item() for k in start) > 1e-3  # the steps moved the weights


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--nproc", "4", "--tp", "3"), "does not divide the 4 processes"),
        (("--nproc", "4", "--tp", "2"), "--tp 2 with --strategy ddp: torch's DDP cannot replicate"),
        (("--nproc", "4", "--tp", "2", "--strategy", "auto"), "--tp 2 with --strategy auto"),
    ],
)
def test_what_tp_does_not_build_is_one_line_before_any_worker(tmp_path, args, said):
    done = run_ddpkit("train", TASK, *args, *COMMON, "--run-dir", str(tmp_path / "r"), check=False, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith("ddpkit: error: ") and said in lines[0], done.stderr
    assert not (tmp_path / "r").exists()  # refused before any worker: no run directory written
