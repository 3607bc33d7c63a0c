"""A run resumed mid-epoch at another world size (or batch, or --accumulate) continues at
exactly the sample where the checkpoint was written: every sample once per epoch, counted by
id. The position is kept in samples of the epoch's global order, never in steps of one world."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from tests.conftest import assert_state_close, load_model, run_ddpkit

TASK = str(Path(__file__).parent / "scripts" / "ids_task.py") + ":build"
N = 90  # not a multiple of any global batch below: the last steps are short


def seen_ids(run: Path) -> list[int]:
    return [
        int(i) for p in sorted(run.glob("ids-rank*.txt")) for line in p.read_text().split("\n") for i in line.split()
    ]


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def train(run: Path, nproc: int, batch: int, accumulate: int, *args: str) -> None:
    run_ddpkit(
        "train",
        TASK,
        "--quiet",
        "--save-every",
        "0",
        "--nproc",
        str(nproc),
        "--batch-size",
        str(batch),
        "--accumulate",
        str(accumulate),
        "--run-dir",
        str(run),
        *args,
    )


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """`stopped(run, world, batch, accumulate, steps)`: `run` becomes a copy of a run of that layout
    stopped (and checkpointed) after `steps` steps; each layout is trained once per module, as
    several tests start from the same stop."""
    done: dict[tuple[int, ...], Path] = {}

    def copy(run: Path, *layout_and_steps: int) -> None:
        if layout_and_steps not in done:
            *first, steps = layout_and_steps
            done[layout_and_steps] = tmp_path_factory.mktemp("stopped") / "run"
            train(done[layout_and_steps], *first, "--max-steps", str(steps), "--save-every-steps", str(steps))
        shutil.copytree(done[layout_and_steps], run)

    return copy


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
def test_a_mid_epoch_resume_at_another_world_size_trains_every_sample_once(tmp_path, stopped, first, then, steps):
    run = tmp_path / "run"
    stopped(run, *first, steps)
    before = seen_ids(run)
    assert len(before) == steps * first[0] * first[1] * first[2]
    for p in run.glob("ids-rank*.txt"):
        p.unlink()
    train(run, *then, "--epochs", "1", "--resume")
    after = seen_ids(run)
    assert not set(before) & set(after), f"trained twice: {sorted(set(before) & set(after))}"
    assert sorted(before + after) == list(range(N)), f"skipped: {sorted(set(range(N)) - set(before + after))}"


def test_the_epoch_resumed_with_the_same_global_batch_ends_where_the_uninterrupted_run_ends(tmp_path, stopped):
    """4 x 2 stopped after 3 steps, resumed as 2 x 4: the same global batches, so the same model
    and the same epoch loss (the loss sums of the first 3 steps are carried). float64 + SGD:
    only the all-reduce's summation order differs."""
    whole, part = tmp_path / "whole", tmp_path / "part"
    train(whole, 4, 2, 1, "--epochs", "1")
    stopped(part, 4, 2, 1, 3)
    train(part, 2, 4, 1, "--epochs", "1", "--resume")
    assert_state_close(load_model(part), load_model(whole), rtol=1e-10, atol=1e-12)
    assert records(part)[-1]["train_loss"] == pytest.approx(records(whole)[-1]["train_loss"], rel=1e-10)
    assert records(part)[-1]["step"] == records(whole)[-1]["step"] == 12  # ceil(90 / 8)


def test_max_steps_counts_the_optimizer_steps_of_the_whole_run_across_a_world_size_change(tmp_path, stopped):
    run = tmp_path / "run"
    stopped(run, 2, 4, 1, 5)
    train(run, 1, 4, 1, "--max-steps", "12", "--resume")  # 7 more steps of 4 samples
    ids = seen_ids(run)
    assert len(ids) == 5 * 8 + 7 * 4 and len(set(ids)) == len(ids)
    assert records(run)[-1]["step"] == 12


def test_the_lr_schedule_follows_the_steps_planned_at_the_new_world_size(tmp_path):
    """Written at 2 x 4 with --max-steps 5 (a 5-step schedule), resumed at 1 x 4 for 2 epochs:
    5 + ceil(50 / 4) + ceil(90 / 4) = 41 steps, and the linear schedule spans those 41."""
    run = tmp_path / "run"
    train(run, 2, 4, 1, "--max-steps", "5", "--save-every-steps", "5", "--lr-schedule", "linear")
    train(run, 1, 4, 1, "--epochs", "2", "--resume", "--lr-schedule", "linear")
    first, last = records(run)[-2:]  # (the first run wrote its partial epoch at step 5 too)
    assert (first["step"], last["step"]) == (5 + 13, 41)
    assert first["lr"] == pytest.approx(0.1 * (1 - 18 / 41), rel=1e-9)
    assert last["lr"] == pytest.approx(0.0, abs=1e-12)


def _as_written_before_samples(path: Path) -> None:
    """Rewrite a mid-epoch checkpoint as ddpkit wrote them before positions were in samples:
    version 1, `step` = steps of its global batch into the epoch, no `samples`."""
    ckpt = torch.load(path, weights_only=True)
    ckpt["step"] = ckpt.pop("samples") // ckpt.pop("global_batch")
    ckpt["version"] = 1
    torch.save(ckpt, path)


def test_a_checkpoint_that_kept_its_place_in_steps_resumes_only_at_its_own_global_batch(tmp_path, stopped):
    run = tmp_path / "run"
    stopped(run, 2, 4, 1, 5)
    (path,) = (run / "checkpoints").glob("*.pt")
    _as_written_before_samples(path)
    before, written = seen_ids(run), path.read_bytes()
    refused = run_ddpkit(
        "train",
        TASK,
        "--quiet",
        "--save-every",
        "0",
        "--nproc",
        "1",
        "--batch-size",
        "4",
        "--epochs",
        "1",
        "--resume",
        "--run-dir",
        str(run),
        check=False,
    )
    assert refused.returncode == 2, refused.stderr
    message = refused.stderr.strip().splitlines()
    assert len(message) == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert "global batch of 8 (2 processes x --batch-size 4 x --accumulate 1)" in message[0]
    assert "this run's global batch is 4" in message[0] and "resume once with 2 processes" in message[0]
    assert seen_ids(run) == before and path.read_bytes() == written  # nothing trained, nothing written
    train(run, 2, 4, 1, "--epochs", "1", "--resume")  # its own global batch: exact
    assert sorted(seen_ids(run)) == list(range(N))


def test_fsdp_sharded_checkpoints_resume_at_another_world_size_at_the_same_sample(tmp_path):
    run = tmp_path / "run"
    train(run, 2, 4, 1, "--strategy", "fsdp", "--max-steps", "5", "--save-every-steps", "5")
    assert (run / "checkpoints" / "epoch-000000-step-000005").is_dir()
    before = seen_ids(run)
    for p in run.glob("ids-rank*.txt"):
        p.unlink()
    train(run, 3, 3, 1, "--strategy", "fsdp", "--epochs", "1", "--resume")
    after = seen_ids(run)
    assert not set(before) & set(after) and sorted(before + after) == list(range(N))


def test_a_fixed_global_batch_continues_the_same_batches_on_another_world_size(tmp_path):
    """--global-batch-size 16: 2 processes x 8, then 3 processes (shares 6, 5, 5, each in 2
    micro-batches of at most 3), then 1 process (4 micro-batches of 4): the same 6 global
    batches as the uninterrupted run, so the same model; every sample once. float64 + SGD."""
    whole, part = tmp_path / "whole", tmp_path / "part"

    def go(run, nproc, batch, *args):
        run_ddpkit(
            "train", TASK, "--quiet", "--save-every", "0", "--global-batch-size", "16",
            "--nproc", str(nproc), "--batch-size", str(batch), "--run-dir", str(run), *args,
        )  # fmt: skip

    go(whole, 2, 8, "--epochs", "1")
    go(part, 2, 8, "--max-steps", "2", "--save-every-steps", "2")
    go(part, 3, 3, "--max-steps", "4", "--save-every-steps", "2", "--resume")
    summary = json.loads((part / "summary.json").read_text())
    assert (summary["global_batch"], summary["accumulate"]) == (16, 2)
    go(part, 1, 4, "--epochs", "1", "--resume")
    assert_state_close(load_model(part), load_model(whole), rtol=1e-10, atol=1e-12)
    assert sorted(seen_ids(part)) == list(range(N))
    assert records(part)[-1]["step"] == records(whole)[-1]["step"] == 6  # ceil(90 / 16)
