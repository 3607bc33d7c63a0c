"""--min-lr and --lr-schedule wsd through the real CLI: the learning rates in metrics.jsonl
follow the formula, and a run resumed from a mid-epoch checkpoint continues the schedule
exactly where the uninterrupted run was."""

import json
import math
import shutil

import pytest

from conftest import assert_state_equal, load_model, run_ddpkit

# Wine: 142 samples at a global batch of 32 are 5 optimizer steps per epoch; 20 steps in all
ARGS = [
    "--nproc",
    "2",
    "--batch-size",
    "16",
    "--lr",
    "0.01",
    "--min-lr",
    "0.001",
    "--warmup-steps",
    "2",
    "--max-steps",
    "20",
    "--eval-every-steps",
    "2",
    "--save-every-steps",
    "7",
    "--save-every",
    "0",
    "--seed",
    "4",
]


def _lrs(run):
    return [(r["step"], r["lr"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.parametrize("shape", [["--lr-schedule", "cosine"], ["--lr-schedule", "wsd", "--decay-fraction", "0.5"]])
def test_a_resumed_run_continues_the_schedule_to_min_lr(tmp_path, shape):
    full, split = tmp_path / "full", tmp_path / "split"
    run_ddpkit("train", *ARGS, *shape, "--quiet", "--run-dir", str(full))
    lrs = dict(_lrs(full))
    assert lrs[20] == pytest.approx(0.001)  # the floor at the last step, not 0
    assert lrs[2] == pytest.approx(0.01)  # warm-up done
    if shape[1] == "wsd":  # stable until step 10, then linear over the last 10 steps
        assert lrs[10] == pytest.approx(0.01) and lrs[16] == pytest.approx(0.001 + 0.009 * 4 / 10)
    else:
        assert lrs[10] == pytest.approx(
            0.001 + 0.009 * 0.5 * (1 + math.cos(math.pi * 8 / 18))
        )  # 8 of 18 decaying steps
    # the same run interrupted after its step-7 checkpoint (inside epoch 2): drop what came later, resume
    shutil.copytree(full, split)
    (split / "model.pt").unlink()
    later = sorted((split / "checkpoints").iterdir())[1:]
    assert [p.name for p in later] == ["epoch-000002-step-000014.pt"]  # named by the run's optimizer step
    for p in later:
        p.unlink()
    proc = run_ddpkit("train", *ARGS, *shape, "--resume", "--run-dir", str(split))
    assert "ddpkit: resuming from" in proc.stdout and "epoch-000001-step-000007.pt" in proc.stdout, proc.stdout
    assert _lrs(split) == _lrs(full)  # every learning rate logged, before and after the resume
    assert_state_equal(load_model(split), load_model(full))
