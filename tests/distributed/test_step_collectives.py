"""An optimizer step issues no collective beyond its gradient sync: the step's agreement (NaN,
stop, count, timed save) rides with it (strategies/agreement.py). Counted from the collective
record between one step's forward and the next, within the first epoch."""

import json
from pathlib import Path

import pytest
from tests.conftest import run_ddpkit

TASK = str(Path(__file__).parent / "scripts" / "counting_collectives.py") + ":build"


@pytest.mark.parametrize(
    "flags, others, buckets",
    [
        (["--grad-sync", "shm"], 0, True),  # the flags in the shared-memory sum's barrier
        (["--grad-sync", "backend"], 0, False),  # in gloo's all-reduce of the first bucket (not recorded)
        (["--strategy", "fsdp"], 1, False),  # FSDP: one small all-reduce, after the backward
    ],
)
def test_a_step_issues_no_collective_beyond_its_gradient_sync(tmp_path, flags, others, buckets):
    run = tmp_path / "run"
    run_ddpkit(
        "train", TASK, "--nproc", "2", "--batch-size", "16", "--epochs", "1", "--straggler-every", "1000",
        "--save-every", "0", "--quiet", "--run-dir", str(run), *flags,
    )  # fmt: skip
    intervals = json.loads((run / "collectives.json").read_text())[:4]  # 5 steps of 32: 4 intervals, then the
    # last step's to the evaluation's first forward (the epoch's loss sum, then the evaluation)
    assert [i["other"] for i in intervals] == [others] * 4, intervals
    assert all((i["gradient"] >= 1) == buckets for i in intervals), intervals
