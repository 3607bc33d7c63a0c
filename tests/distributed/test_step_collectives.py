"""An optimizer step issues no collective beyond its gradient sync: the step's agreement (NaN,
stop, count, timed save) rides with it (strategies/agreement.py). Counted from the collective
record between one step's forward and the next, within the first epoch."""

import json
from pathlib import Path

import pytest
from tests.conftest import run_ddpkit

TASK = str(Path(__file__).parent / "scripts" / "counting_collectives.py")


@pytest.mark.parametrize(
    "flags, others, buckets, task",
    [
        (["--grad-sync", "shm"], 0, True, "build"),  # the flags in the shared-memory sum's barrier
        (["--grad-sync", "backend"], 0, False, "build"),  # in gloo's all-reduce of the first bucket (not recorded)
        # a first bucket over CARRY_MAX: their own all-reduce, issued beside it by the hook (not recorded
        # either); 1 if they fell back to the all-reduce after the backward
        (["--grad-sync", "backend"], 0, False, "wide"),
        (["--strategy", "fsdp"], 1, False, "build"),  # FSDP: one small all-reduce, after the backward
    ],
)
def test_a_step_issues_no_collective_beyond_its_gradient_sync(tmp_path, flags, others, buckets, task):
    run = tmp_path / "run"
    run_ddpkit(
        "train", f"{TASK}:{task}", "--nproc", "2", "--batch-size", "16", "--epochs", "1", "--straggler-every", "1000",
        "--save-every", "0", "--quiet", "--run-dir", str(run), *flags,
    )  # fmt: skip
    intervals = json.loads((run / "collectives.json").read_text())[:4]  # 5 steps of 32: 4 intervals, then the
    # last step's to the evaluation's first forward (the epoch's loss sum, then the evaluation)
    assert [i["other"] for i in intervals] == [others] * 4, intervals
    assert all((i["gradient"] >= 1) == buckets for i in intervals), intervals


def test_the_flags_beside_a_large_first_bucket_stop_every_rank_on_one_ranks_nan(tmp_path):
    proc = run_ddpkit(
        "train", f"{TASK}:wide_nan", "--nproc", "2", "--grad-sync", "backend", "--batch-size", "16",
        "--epochs", "1", "--save-every", "0", "--quiet", "--run-dir", str(tmp_path / "run"), check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "not finite in epoch 1, step" in proc.stderr and "(on 1 of 2 rank(s))" in proc.stderr
