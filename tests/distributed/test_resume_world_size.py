"""A run resumed mid-epoch at another world size (or batch, or --accumulate) continues at
exactly the sample where the checkpoint was written: every sample once per epoch, counted by
id. The position is kept in samples of the epoch's global order, never in steps of one world."""
import json
from pathlib import Path

import pytest
import torch

from tests.conftest import assert_state_close, load_model, run_ddpkit

TASK = str(Path(__file__).parent / "scripts" / "ids_task.py") + ":build"
N = 90  # not a multiple of any global batch below: the last steps are short


def seen_ids(run: Path) -> list[int]:
    return [int(i) for p in sorted(run.glob("ids-rank*.txt")) for line in p.read_text().split("\n") for i in line.split()]


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def train(run: Path, nproc: int, batch: int, accumulate: int, *args: str) -> None:
    run_ddpkit("train", TASK, "--quiet", "--save-every", "0", "--nproc", str(nproc), "--batch-size", str(batch),
               "--accumulate", str(accumulate), "--run-dir", str(run), *args)


# (first world, batch, accumulate) -> (resumed world, batch, accumulate), steps before the stop
CASES = [
    pytest.param((2, 4, 1), (1, 4, 1), 5, id="2to1-batch-kept"),
    pytest.param((1, 4, 1), (3, 4, 1), 5, id="1to3-batch-kept"),
    pytest.param((4, 2, 1), (2, 4, 1), 3, id="4to2-global-batch-kept"),
    pytest.param((2, 2, 2), (1, 3, 1), 4, id="2to1-accumulate-then-not"),
    pytest.param((1, 5, 1), (3, 3, 2), 4, id="1to3-batch-changed-accumulate"),
    pytest.param((4, 3, 1), (2, 5, 1), 2, id="4to2-batch-changed"),
]


@pytest.mark.parametrize("first,then,steps", CASES)
def test_a_mid_epoch_resume_at_another_world_size_trains_every_sample_once(tmp_path, first, then, steps):
    run = tmp_path / "run"
    train(run, *first, "--max-steps", str(steps), "--save-every-steps", str(steps))
    before = seen_ids(run)
    assert len(before) == steps * first[0] * first[1] * first[2]
    for p in run.glob("ids-rank*.txt"):
        p.unlink()
    train(run, *then, "--epochs", "1", "--resume")
    after = seen_ids(run)
    assert not set(before) & set(after), f"trained twice: {sorted(set(before) & set(after))}"
    assert sorted(before + after) == list(range(N)), f"skipped: {sorted(set(range(N)) - set(before + after))}"
