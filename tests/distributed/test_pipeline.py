"""Pipeline parallel through the real CLI (gloo, CPU): a nanoGPT-shaped float64 model cut into
stages trains to the same weights and eval loss as one process, under each schedule and
composed with DDP (2 pipelines of 2 stages at 4 processes); a checkpoint written by the
stages resumes at one process to the uninterrupted run; a model that cannot be cut is one
line, exit 2."""

import json
import shutil

import pytest

from conftest import REPO, assert_state_close, load_model, run_ddpkit

TASK = str(REPO / "tests" / "distributed" / "scripts" / "pipeline_task.py") + ":build"
# a global batch of 8 (per data-parallel rank: 8 / dp), 6 steps an epoch, clipped (the norm over every stage)
COMMON = ["--seed", "7", "--threads", "1", "--quiet", "--clip-grad-norm", "0.5"]


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def _train(run_dir, *args):
    return run_ddpkit("train", TASK, *COMMON, *args, "--run-dir", str(run_dir))


def _same(run_dir, reference):
    assert_state_close(load_model(run_dir), load_model(reference), rtol=0, atol=1e-4)
    assert abs(_summary(run_dir)["eval_loss"] - _summary(reference)["eval_loss"]) < 1e-4


@pytest.fixture(scope="module")
def one_process(reference_run):
    return reference_run(TASK, *COMMON, "--epochs", "1", "--batch-size", "8", "--save-every", "0")


def test_two_stages_under_each_schedule_equal_one_process(one_process, tmp_path):
    for schedule, microbatches in (("1f1b", "4"), ("gpipe", "2"), ("interleaved-1f1b", "4")):
        run = tmp_path / schedule
        _train(
            run,
            "--epochs",
            "1",
            "--nproc",
            "2",
            "--batch-size",
            "8",
            "--save-every",
            "0",
            "--pp",
            "2",
            "--pp-schedule",
            schedule,
            "--pp-microbatches",
            microbatches,
        )
        _same(run, one_process)
        assert _summary(run)["world_size"] == 2


def test_ddp_x_pp_2x2_at_4_processes_equals_one_process(one_process, tmp_path):
    _train(tmp_path, "--epochs", "1", "--nproc", "4", "--batch-size", "4", "--save-every", "0", "--pp", "2")
    _same(tmp_path, one_process)


def test_a_pipeline_checkpoint_resumes_at_one_process_to_the_uninterrupted_run(reference_run, tmp_path):
    adam = ("--task-arg", "optimizer=adamw")
    whole = reference_run(TASK, *COMMON, *adam, "--epochs", "2", "--batch-size", "8")
    _train(tmp_path, *adam, "--epochs", "1", "--nproc", "2", "--batch-size", "8", "--pp", "2")
    assert list((tmp_path / "checkpoints").glob("epoch-000001/.metadata"))  # the sharded kind
    _train(tmp_path, *adam, "--epochs", "2", "--batch-size", "8", "--resume")
    _same(tmp_path, whole)


@pytest.mark.parametrize(
    "args, says",
    [
        (("--task-arg", "model=tied"), "shared across pipeline stages"),
        (("--task-arg", "layers=1"), "fewer than the 2 stages"),
    ],
)
def test_a_model_that_cannot_be_cut_is_one_line_exit_2(args, says, tmp_path):
    proc = run_ddpkit(
        "train", TASK, *COMMON, "--nproc", "2", "--pp", "2", *args, "--run-dir", str(tmp_path / "r"), check=False
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and says in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    shutil.rmtree(tmp_path / "r", ignore_errors=True)
