"""Streaming data through the real CLI: every sample trained on by exactly one rank (and
worker) once per pass, uneven ends that stop every rank at the same step, exact resume,
--keep-last after a crash mid-save, and clear errors for bad streams."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, assert_state_equal, load_model, run_ddpkit

SCRIPTS = REPO / "tests" / "distributed" / "scripts"
TASK = str(SCRIPTS / "stream_task.py") + ":build"
sys.path.insert(0, str(SCRIPTS))
from stream_task import write_shards  # noqa: E402

QUIET = ["--quiet", "--save-every", "0", "--seed", "1", "--batch-size", "4"]


def seen_ids(run):
    return [
        int(i)
        for p in sorted(Path(run).glob("ids-rank*.txt"))
        for line in p.read_text().split("\n")
        for i in line.split()
    ]


@pytest.mark.parametrize("nproc, workers", [(1, 0), (1, 2), (2, 0), (2, 2), (3, 0), (3, 2)])
def test_every_sample_is_trained_on_once_per_pass(tmp_path, nproc, workers):
    # 6 shards of 10: every rank and worker gets whole shards, as many batches as the others
    shards = write_shards(tmp_path / "shards", 6, 10)
    run = tmp_path / "run"
    run_ddpkit(
        "train",
        TASK,
        "--task-arg",
        f"shards_dir={Path(shards[0]).parent}",
        "--nproc",
        str(nproc),
        "--num-workers",
        str(workers),
        "--epochs",
        "2",
        "--run-dir",
        str(run),
        *QUIET,
    )
    ids = seen_ids(run)
    assert sorted(ids) == sorted(list(range(60)) * 2), (len(ids), sorted(set(range(60)) - set(ids)))
    assert (run / "model.pt").is_file()


def test_a_plain_iterable_dataset_is_dealt_out_round_robin(tmp_path):
    run = tmp_path / "run"
    run_ddpkit(
        "train",
        TASK,
        "--task-arg",
        "plain=48",
        "--nproc",
        "2",
        "--num-workers",
        "2",
        "--epochs",
        "1",
        "--run-dir",
        str(run),
        *QUIET,
    )
    assert sorted(seen_ids(run)) == list(range(48))


def test_ranks_that_run_out_at_different_steps_all_stop_at_the_same_step(tmp_path):
    # 7 shards of 10 on 2 ranks: rank 0 reads 4 (40 samples), rank 1 reads 3 (30)
    shards = write_shards(tmp_path / "shards", 7, 10)
    run = tmp_path / "run"
    proc = run_ddpkit(
        "train",
        TASK,
        "--task-arg",
        f"shards_dir={Path(shards[0]).parent}",
        "--nproc",
        "2",
        "--epochs",
        "2",
        "--run-dir",
        str(run),
        *QUIET,
        timeout=120,
    )
    assert proc.returncode == 0
    steps = {
        p.name: [[int(i) for i in line.split()] for line in p.read_text().splitlines()]
        for p in run.glob("ids-rank*.txt")
    }
    # rank 1's 30 samples make 8 batches (7 x 4 + 2); at step 9 it has none, so the pass ends on
    # both ranks after 8 steps, and the 8 samples rank 0 still had are dropped
    assert sorted(len(lines) for lines in steps.values()) == [16, 16]  # 8 steps per pass, 2 passes
    for p in (0, 1):
        trained = [i for lines in steps.values() for line in lines[8 * p : 8 * p + 8] for i in line]
        assert len(trained) == 62 and len(set(trained)) == 62, (p, len(trained))
    assert (run / "model.pt").is_file()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_resumed_mid_pass_ends_bit_identical(tmp_path, workers):
    shards = write_shards(tmp_path / "shards", 6, [9, 11, 10, 7, 13, 10])
    args = [
        TASK,
        "--task-arg",
        f"shards_dir={Path(shards[0]).parent}",
        "--nproc",
        "2",
        "--num-workers",
        str(workers),
        "--quiet",
        "--seed",
        "1",
        "--batch-size",
        "4",
        "--save-every",
        "0",
    ]
    run_ddpkit("train", *args, "--epochs", "2", "--run-dir", str(tmp_path / "full"))
    part = tmp_path / "part"
    run_ddpkit("train", *args, "--max-steps", "5", "--save-every-steps", "5", "--run-dir", str(part))
    assert [p.name for p in (part / "checkpoints").iterdir()] == ["epoch-000000-step-000005.pt"]
    run_ddpkit("train", *args, "--epochs", "2", "--resume", "--run-dir", str(part))
    assert_state_equal(load_model(part), load_model(tmp_path / "full"))
    assert sorted(seen_ids(part)) == sorted(seen_ids(tmp_path / "full"))  # nothing trained twice or skipped


def test_keep_last_holds_exactly_k_complete_checkpoints_after_a_crash_mid_save(tmp_path):
    run = tmp_path / "run"
    crash = str(SCRIPTS / "fault_tasks.py") + ":crash_in_save"
    args = ["--nproc", "2", "--epochs", "8", "--save-every", "1", "--keep-last", "2", "--quiet", "--run-dir", str(run)]
    proc = run_ddpkit("train", crash, *args, check=False, env={"DDPKIT_TEST_CRASH_AT_SAVE": "5"})
    assert proc.returncode != 0
    ckpts = run / "checkpoints"
    complete = sorted(p.name for p in ckpts.glob("epoch-*.pt"))
    assert complete == ["epoch-000003.pt", "epoch-000004.pt"], sorted(p.name for p in ckpts.iterdir())
    assert list(ckpts.glob(".epoch-000005.pt.*.tmp")), "the crash should have left its temporary behind"
    run_ddpkit("train", crash, *args, "--resume")
    assert sorted(p.name for p in ckpts.glob("epoch-*.pt")) == ["epoch-000007.pt", "epoch-000008.pt"]


@pytest.mark.parametrize(
    "task_args, fragment",
    [
        (["--task-arg", "shards_dir=/nonexistent/empty"], "the shard list is empty"),
        (["bad=missing"], "cannot read shard"),
        (["bad=strings"], "hold no tensor"),
    ],
)
def test_bad_streams_get_one_clear_line(tmp_path, task_args, fragment):
    shards = write_shards(tmp_path / "shards", 2, 5)
    extra = (
        task_args
        if task_args[0] == "--task-arg"
        else ["--task-arg", f"shards_dir={Path(shards[0]).parent}", "--task-arg", task_args[0]]
    )
    proc = run_ddpkit(
        "train",
        TASK,
        *extra,
        "--nproc",
        "2",
        "--epochs",
        "1",
        "--run-dir",
        str(tmp_path / "r"),
        "--quiet",
        check=False,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert fragment in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def _tensors_equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_tensors_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_async_save_writes_the_blocking_saves_checkpoints_and_resumes_from_them(tmp_path):
    args = ["--nproc", "2", "--epochs", "6", "--save-every", "2", "--quiet", "--seed", "4"]
    run_ddpkit("train", *args, "--run-dir", str(tmp_path / "sync"))
    run_ddpkit("train", *args, "--async-save", "--keep-last", "2", "--run-dir", str(tmp_path / "async"))
    names = sorted(p.name for p in (tmp_path / "async" / "checkpoints").iterdir())
    assert names == ["epoch-000004.pt", "epoch-000006.pt"]  # complete at exit, the oldest pruned
    for name in names:
        a = torch.load(tmp_path / "async" / "checkpoints" / name, weights_only=True)
        b = torch.load(tmp_path / "sync" / "checkpoints" / name, weights_only=True)
        a["extra"].pop("ledger"), b["extra"].pop("ledger")  # the seconds each run spent: its own
        for key in ("model", "optimizer", "epoch", "rng", "extra"):
            assert _tensors_equal(a[key], b[key]), (name, key)
    split = tmp_path / "split"
    shutil.copytree(tmp_path / "async", split)
    (split / "model.pt").unlink()
    (split / "checkpoints" / "epoch-000006.pt").unlink()
    run_ddpkit("train", *args, "--async-save", "--resume", "--run-dir", str(split))
    assert_state_equal(load_model(split), load_model(tmp_path / "sync"))


def test_keep_best_keeps_the_best_checkpoints_by_the_metric_and_the_newest(tmp_path):
    run = tmp_path / "run"
    run_ddpkit(
        "train",
        "--nproc",
        "2",
        "--epochs",
        "8",
        "--save-every",
        "1",
        "--keep-best",
        "2",
        "--keep-last",
        "1",
        "--best-metric",
        "eval_loss",
        "--quiet",
        "--seed",
        "2",
        "--lr",
        "0.05",
        "--run-dir",
        str(run),
    )
    losses = {
        r["epoch"]: r["eval_loss"] for r in (json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines())
    }
    best = sorted(losses, key=losses.get)[:2]
    expected = sorted({f"epoch-{e:06d}.pt" for e in best} | {"epoch-000008.pt"})
    assert sorted(p.name for p in (run / "checkpoints").glob("epoch-*.pt")) == expected, losses
    recorded = json.loads((run / "checkpoints" / "metrics.json").read_text())
    assert recorded["epoch-000003"] == pytest.approx(losses[3])


@pytest.mark.skipif(
    importlib.util.find_spec("datasets") is None, reason="needs the datasets extra (pip install 'ddpkit[datasets]')"
)
@pytest.mark.parametrize("hf_shards", [6, 2])
def test_a_hugging_face_streaming_set_is_read_by_its_shards_and_resumes(tmp_path, hf_shards):
    # 6 shards: each of the 2 ranks x 2 workers reads its own; 2 shards: fewer than readers, round-robin
    args = [
        TASK,
        "--task-arg",
        "hf=48",
        "--task-arg",
        f"hf_shards={hf_shards}",
        "--nproc",
        "2",
        "--num-workers",
        "2",
        "--quiet",
        "--seed",
        "1",
        "--batch-size",
        "4",
        "--save-every",
        "0",
    ]
    run_ddpkit("train", *args, "--epochs", "2", "--run-dir", str(tmp_path / "full"))
    assert sorted(seen_ids(tmp_path / "full")) == sorted(list(range(48)) * 2)
    part = tmp_path / "part"
    run_ddpkit("train", *args, "--max-steps", "3", "--save-every-steps", "3", "--run-dir", str(part))
    run_ddpkit("train", *args, "--epochs", "2", "--resume", "--run-dir", str(part))
    assert_state_equal(load_model(part), load_model(tmp_path / "full"))


def test_a_stream_resumed_at_another_world_size_repeats_no_sample(tmp_path):
    shards = write_shards(tmp_path / "shards", 6, 10)
    args = [
        TASK,
        "--task-arg",
        f"shards_dir={Path(shards[0]).parent}",
        "--quiet",
        "--seed",
        "1",
        "--batch-size",
        "4",
        "--save-every",
        "0",
    ]
    run = tmp_path / "run"
    run_ddpkit("train", *args, "--nproc", "2", "--max-steps", "3", "--save-every-steps", "3", "--run-dir", str(run))
    first = seen_ids(run)
    assert len(first) == 24  # 3 steps x 2 ranks x 4
    for p in run.glob("ids-rank*.txt"):
        p.rename(p.with_suffix(".before"))
    run_ddpkit("train", *args, "--nproc", "3", "--epochs", "1", "--resume", "--run-dir", str(run))
    rest = seen_ids(run)
    # the partly read shards continue at their positions on their new readers: nothing twice;
    # the pass still ends when the first of the 3 ranks runs out (what the others held is dropped)
    assert not set(first) & set(rest) and len(rest) == len(set(rest)), sorted(set(first) & set(rest))
    assert len(first) + len(rest) >= 48


def test_save_every_minutes_checkpoints_inside_passes(tmp_path):
    run = tmp_path / "run"
    run_ddpkit(
        "train",
        "--nproc",
        "2",
        "--epochs",
        "3",
        "--batch-size",
        "8",
        "--save-every",
        "0",
        "--save-every-minutes",
        "1e-9",
        "--keep-last",
        "3",
        "--quiet",
        "--run-dir",
        str(run),
    )
    names = sorted(p.name for p in (run / "checkpoints").glob("epoch-*.pt"))
    # due at every step boundary inside a pass (9 steps of 16); the 3 newest complete ones stay, named by the
    # run's optimizer step (the 6th to 8th steps of the third pass) and holding their place in samples
    assert names == ["epoch-000002-step-000024.pt", "epoch-000002-step-000025.pt", "epoch-000002-step-000026.pt"], names
    for n, in_pass in zip(names, (6, 7, 8), strict=True):
        ckpt = torch.load(run / "checkpoints" / n, weights_only=True)
        assert (ckpt["global_step"], ckpt["samples"], ckpt["global_batch"]) == (int(n[-9:-3]), in_pass * 16, 16)


def test_an_own_loop_takes_a_stream_through_rt_loader(tmp_path):
    out = tmp_path / "ids.json"
    run_ddpkit("launch", "--nproc", "2", str(SCRIPTS / "own_loop_stream.py"), str(out))
    assert json.loads(out.read_text()) == [list(range(30)), list(range(30))]  # each item once per pass
