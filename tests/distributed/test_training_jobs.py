"""The jobs people run, through the real CLI on gloo: dict batches and the model's own loss,
a token-level step hook that stays exact across world sizes and accumulation, LR schedules
and clipping that resume bit for bit, runs by steps, task arguments, and the refusals."""

import json
import shutil

import pytest

from conftest import REPO, assert_state_close, assert_state_equal, load_model, run_ddpkit

TOKENS = str(REPO / "tests" / "distributed" / "scripts" / "token_task.py")
TASK = TOKENS + ":build"
QUIET = ["--quiet", "--save-every", "0", "--seed", "2"]


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def token_runs(tmp_path_factory):
    """The token task (72 items of 2..10 real tokens) at one global batch of 16 items:
    1 x 16, 2 x 8, 2 x 4 with --accumulate 2, and FSDP 2 x 8."""
    root = tmp_path_factory.mktemp("tokens")
    common = [TASK, "--epochs", "3", *QUIET]
    run_ddpkit("train", *common, "--nproc", "1", "--batch-size", "16", "--run-dir", str(root / "1x16"))
    run_ddpkit("train", *common, "--nproc", "2", "--batch-size", "8", "--run-dir", str(root / "2x8"))
    run_ddpkit(
        "train", *common, "--nproc", "2", "--batch-size", "4", "--accumulate", "2", "--run-dir", str(root / "2x4x2")
    )
    run_ddpkit(
        "train", *common, "--nproc", "2", "--batch-size", "8", "--strategy", "fsdp", "--run-dir", str(root / "fsdp")
    )
    return root


def test_a_token_level_step_hook_trains_the_same_model_at_any_world_size_and_accumulation(token_runs):
    one = load_model(token_runs / "1x16")
    for name in ("2x8", "2x4x2", "fsdp"):
        assert_state_close(load_model(token_runs / name), one, rtol=1e-5, atol=1e-5)
    first, last = _records(token_runs / "1x16")[0], _records(token_runs / "1x16")[-1]
    assert last["train_loss"] < first["train_loss"]
    # the reported losses are token means over the global batch, equal at every world size
    for name in ("2x8", "2x4x2", "fsdp"):
        assert _records(token_runs / name)[-1]["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-5)
    assert "eval_accuracy" not in last  # no metric for dict batches unless the task gives one


def test_dict_items_are_keyword_arguments_and_the_models_own_loss_is_used(tmp_path):
    run_ddpkit(
        "train",
        TASK,
        "--task-arg",
        "use_step=False",
        "--epochs",
        "4",
        "--nproc",
        "2",
        "--batch-size",
        "8",
        "--run-dir",
        str(tmp_path / "own"),
        *QUIET,
    )
    records = _records(tmp_path / "own")
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    config = json.loads((tmp_path / "own" / "config.json").read_text())
    assert config["task_args"] == {"use_step": False}
    # the model was really trained: its weights differ from the untrained ones, and load into it
    import sys

    sys.path.insert(0, str(REPO / "tests" / "distributed" / "scripts"))
    from token_task import TinyTokenModel

    model = TinyTokenModel(13, 16)
    model.load_state_dict(load_model(tmp_path / "own"))


def test_a_schedule_and_clipping_resume_bit_identically(tmp_path):
    # 142 Wine samples, global batch 32: 5 steps per epoch; cosine over 30 steps after 4 of warm-up
    args = [
        "--nproc",
        "2",
        "--batch-size",
        "16",
        "--lr",
        "0.01",
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "4",
        "--clip-grad-norm",
        "0.5",
        "--seed",
        "3",
        "--save-every",
        "3",
        "--epochs",
        "6",
    ]
    full, split = tmp_path / "full", tmp_path / "split"
    run_ddpkit("train", "--run-dir", str(full), "--quiet", *args)
    # the same run stopped after its epoch-3 checkpoint: copy it, drop what came after, resume
    shutil.copytree(full, split)
    (split / "model.pt").unlink()
    (split / "checkpoints" / "epoch-000006.pt").unlink()
    proc = run_ddpkit("train", "--resume", "--run-dir", str(split), *args)
    assert "ddpkit: resuming from" in proc.stdout and "epoch 3 done" in proc.stdout
    records = _records(full)
    lrs = [r["lr"] for r in records]
    assert lrs[0] < 0.01 and max(lrs) <= 0.01 and lrs[-1] < lrs[1], lrs  # warming up, then decaying
    assert all(r["grad_norm"] > 0 for r in records)
    assert [r["lr"] for r in _records(split)] == lrs  # the schedule continued where it was, not from step 0
    assert_state_equal(load_model(split), load_model(full))


def test_a_task_scheduler_is_stepped_per_optimizer_step_and_checkpointed(tmp_path):
    args = [
        TASK,
        "--task-arg",
        "schedule=True",
        "--nproc",
        "2",
        "--batch-size",
        "8",
        "--seed",
        "1",
        "--quiet",
        "--save-every-steps",
        "4",
        "--save-every",
        "0",
    ]
    full, part = tmp_path / "full", tmp_path / "part"
    run_ddpkit("train", *args, "--epochs", "3", "--run-dir", str(full))
    # the same run stopped after its step-8 checkpoint (inside epoch 2): copy it, drop what came later, resume
    shutil.copytree(full, part)
    (part / "model.pt").unlink()
    later = sorted((part / "checkpoints").iterdir())[2:]
    assert [p.name for p in later] == ["epoch-000002-step-000012.pt"]
    later[0].unlink()
    run_ddpkit("train", *args, "--epochs", "3", "--resume", "--run-dir", str(part))  # from step 8, its newest
    # StepLR(step_size=2, gamma=0.7) over 5 optimizer steps per epoch (72 items, global batch 16)
    lrs = [r["lr"] for r in _records(tmp_path / "full")]
    assert lrs == pytest.approx([0.05 * 0.7 ** (5 // 2), 0.05 * 0.7 ** (10 // 2), 0.05 * 0.7 ** (15 // 2)])
    assert_state_equal(load_model(tmp_path / "part"), load_model(tmp_path / "full"))


def test_runs_by_steps_evaluate_and_checkpoint_inside_epochs(tmp_path):
    run = tmp_path / "steps"
    run_ddpkit(
        "train",
        "--nproc",
        "2",
        "--batch-size",
        "16",
        "--max-steps",
        "12",
        "--eval-every-steps",
        "4",
        "--save-every-steps",
        "4",
        "--save-every",
        "0",
        "--quiet",
        "--run-dir",
        str(run),
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps_done"] == 12 and summary["epochs_done"] == 3  # 5 steps per epoch: 2 epochs and 2 steps
    records = _records(run)
    evals = [(r["epoch"], r["step"]) for r in records if "eval_loss" in r]
    assert (1, 4) in evals and (2, 8) in evals and records[-1]["step"] == 12 and "eval_loss" in records[-1]
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["epoch-000000-step-000004.pt", "epoch-000001-step-000008.pt", "epoch-000002-step-000012.pt"], names
    assert (run / "model.pt").is_file()
    # continuing the stopped run to 15 steps equals running 15 at once
    run_ddpkit(
        "train",
        "--nproc",
        "2",
        "--batch-size",
        "16",
        "--max-steps",
        "15",
        "--resume",
        "--quiet",
        "--save-every",
        "0",
        "--run-dir",
        str(run),
    )
    run_ddpkit(
        "train",
        "--nproc",
        "2",
        "--batch-size",
        "16",
        "--max-steps",
        "15",
        "--quiet",
        "--save-every",
        "0",
        "--run-dir",
        str(tmp_path / "once"),
    )
    assert_state_equal(load_model(run), load_model(tmp_path / "once"))


@pytest.mark.parametrize(
    "args, fragment",
    [
        ([TASK, "--task-arg", "nope=1"], "takes no argument 'nope' (--task-arg); it takes: vocab, seq, samples, width"),
        (["--clip-grad-norm", "0"], "--clip-grad-norm must be a positive norm"),
        ([TOKENS + ":not_a_scheduler"], "scheduler(optimizer) must return a torch LR scheduler"),
        (["--precision", "fp16", "--device", "cpu"], "--precision fp16 needs a CUDA GPU"),
        (
            ["--warmup-steps", "500", "--lr-schedule", "linear", "--epochs", "2"],
            "--warmup-steps 500 is not less than the run's",
        ),
        ([TASK, "--task-arg", "schedule=True", "--lr-schedule", "cosine"], "own scheduler and --lr-schedule"),
        (
            [TOKENS + ":namespace_output", "--strategy", "fsdp"],
            "FSDP cannot see, so its gradients would never be synced",
        ),
    ],
)
def test_bad_training_settings_get_one_line_and_exit_2(tmp_path, args, fragment):
    proc = run_ddpkit("train", *args, "--nproc", "2", "--run-dir", str(tmp_path / "r"), "--quiet", check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert fragment in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.startswith("ddpkit: error")]) == 1, proc.stderr
    assert not (tmp_path / "r" / "model.pt").exists()


def test_a_task_scheduler_can_ask_for_the_runs_planned_steps(tmp_path):
    # scheduler(optimizer, total_steps): linear to 0 over the run's 3 x 5 = 15 steps
    run_ddpkit(
        "train",
        TASK,
        "--task-arg",
        "schedule=2",
        "--nproc",
        "2",
        "--batch-size",
        "8",
        "--epochs",
        "3",
        "--quiet",
        "--save-every",
        "0",
        "--run-dir",
        str(tmp_path / "r"),
    )
    assert [r["lr"] for r in _records(tmp_path / "r")] == pytest.approx(
        [0.05 * (1 - 5 / 15), 0.05 * (1 - 10 / 15), 0.0]
    )
