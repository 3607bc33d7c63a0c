"""One nanoGPT-shaped model of separate q/k/v projections (examples/gpt.py's GPT, qkv=separate,
tie=False, float64, SGD, clipped: tests/distributed/scripts/gpt_mesh_task.py) trained on the three
2x2 meshes of 4 processes, FSDP x TP (dp_shard 2, tp 2), HSDP x TP (dp_replicate 2, dp_shard 1,
tp 2) and DDP x PP (2 pipelines of 2 stages), ends with the one-process model: every weight, the
last eval loss (9 held-out windows, uneven over the 2 data-parallel ranks, each counted once) and
the clipped gradient norm. One one-process run is the reference of all three. What cannot be
split is one line before any worker starts: examples/gpt.py's fused qkv under --tp 2 (the model
built on the meta device in the launcher), --tp 3 at 4 processes."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import REPO, load_model, run_ddpkit

TASK = str(REPO / "tests" / "distributed" / "scripts" / "gpt_mesh_task.py") + ":build"
GPT = str(REPO / "examples" / "gpt.py") + ":build"
# 4 steps of a global batch of 8 (one process: 2 micro-batches of 4), the norm clipped at 0.5 (it is ~1.2)
COMMON = ["--epochs", "1", "--max-steps", "4", "--seed", "7", "--threads", "1", "--quiet", "--save-every", "0"]
COMMON += ["--batch-size", "4", "--global-batch-size", "8", "--clip-grad-norm", "0.5"]
MESHES = {
    "fsdp-x-tp": ("--tp", "2", "--strategy", "fsdp"),
    "hsdp-x-tp": ("--tp", "2", "--strategy", "hsdp", "--replicate", "2"),
    "ddp-x-pp": ("--pp", "2", "--pp-microbatches", "2", "--strategy", "ddp"),
}


def _last(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()][-1]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESHES), ids=list(MESHES))
def test_each_2x2_mesh_trains_what_one_process_trains(reference_run, tmp_path, mesh):
    one = reference_run(TASK, "--nproc", "1", *COMMON)
    run = tmp_path / mesh
    run_ddpkit("train", TASK, "--nproc", "4", *MESHES[mesh], *COMMON, "--run-dir", str(run))
    got, want = load_model(run), load_model(one)  # model.pt: the whole weights, whatever the mesh
    assert got.keys() == want.keys()
    for name, weight in want.items():
        assert got[name].shape == weight.shape, name
        assert torch.allclose(got[name], weight, atol=1e-9, rtol=0), name  # asked: 1e-4; measured <= 1.2e-16
    last, ref = _last(run), _last(one)
    assert last["step"] == ref["step"] == 4
    assert abs(last["eval_loss"] - ref["eval_loss"]) < 1e-9
    assert abs(last["grad_norm"] - ref["grad_norm"]) < 1e-6 and ref["grad_norm"] > 0.5  # clipping acted
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 4


def _refused(tmp_path, task: str, tp: str, timeout: int) -> list[str]:
    """`ddpkit train TASK --nproc 4 --tp TP --strategy fsdp`: exit 2, its non-empty lines on stderr,
    and no run directory (refused in the launcher, before any worker)."""
    run = tmp_path / "r"
    done = run_ddpkit(
        "train", task, "--nproc", "4", "--tp", tp, "--strategy", "fsdp", *COMMON, "--run-dir", str(run),
        check=False, timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert not run.exists()
    return [line for line in done.stderr.splitlines() if line.strip()]


def test_a_fused_qkv_under_tp_is_one_line_before_any_worker(tmp_path):
    lines = _refused(tmp_path, GPT, "2", timeout=120)
    assert lines == [
        "ddpkit: error: blocks.0.attn.qkv: q/k/v fused into one Linear cannot be column-split by heads: "
        "split it or give tp_plan"
    ], lines


def test_tp_3_at_4_processes_is_one_line(tmp_path):
    lines = _refused(tmp_path, TASK, "3", timeout=60)
    assert len(lines) == 1 and "--tp 3" in lines[0] and "does not divide the 4 processes" in lines[0], lines
