"""Pipeline parallel through the real CLI (gloo, CPU): a nanoGPT-shaped float64 model cut into
stages trains, under SGD with momentum and a clipped gradient norm, to the same weights, losses
and gradient norms as one process: 2 stages under each schedule, and DDP x PP (2 pipelines of 2
stages) at 4 processes; evaluation of an odd held-out set (uneven over the pipelines) gives the
one-process eval loss on rank 0's report; model.pt holds every stage's weights, loadable by the
one-process model. What --pp does not build is refused in one line (checkpoints under --pp, and
their resume on other meshes: test_checkpoint_across_meshes.py). One reference run serves every
comparison."""

import importlib.util
import json

import pytest

from conftest import REPO, assert_state_close, load_model, run_ddpkit

SCRIPT = REPO / "tests" / "distributed" / "scripts" / "pipeline_task.py"
TASK = f"{SCRIPT}:build"
# a global batch of 8 (per data-parallel rank: 8 / dp), 6 steps an epoch, 2 epochs
COMMON = ["--seed", "7", "--threads", "1", "--quiet", "--clip-grad-norm", "0.5", "--epochs", "2"]
TOL = 1e-6


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _same(run_dir, reference):
    """The weights, each epoch's train and eval loss and the last gradient norm: within TOL."""
    assert_state_close(load_model(run_dir), load_model(reference), rtol=0, atol=TOL)
    for got, want in zip(_metrics(run_dir), _metrics(reference), strict=True):
        for key in ("train_loss", "eval_loss", "grad_norm"):
            assert abs(got[key] - want[key]) < TOL, (key, got, want)


def _train(run_dir, *args, check=True):
    return run_ddpkit("train", TASK, *COMMON, *args, "--run-dir", str(run_dir), check=check)


@pytest.fixture(scope="module")
def one_process(reference_run):
    return reference_run(TASK, *COMMON, "--nproc", "1", "--batch-size", "8")


def test_two_stages_under_each_schedule_equal_one_process(one_process, tmp_path):
    for schedule, microbatches in (("1f1b", "4"), ("gpipe", "2"), ("interleaved-1f1b", "4")):
        run = tmp_path / schedule
        pp = ("--pp", "2", "--pp-schedule", schedule, "--pp-microbatches", microbatches)
        _train(run, "--nproc", "2", "--batch-size", "8", "--save-every", "0", *pp)
        _same(run, one_process)
        assert json.loads((run / "summary.json").read_text())["world_size"] == 2


def test_ddp_x_pp_at_4_processes_equals_one_process(one_process, tmp_path):
    # DDP x PP: 2 pipelines of 2 stages under 1F1B; model.pt holds every stage's weights under the
    # whole model's names, loadable (strict) by the one-process model
    mesh = tmp_path / "mesh"
    _train(mesh, "--nproc", "4", "--batch-size", "4", "--pp", "2", "--save-every", "0")
    _same(mesh, one_process)
    spec = importlib.util.spec_from_file_location("pipeline_task", SCRIPT)
    task_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(task_module)
    task_module.build().model.load_state_dict(load_model(mesh))


def _refused(tmp_path, *args):
    proc = _train(tmp_path / "r", *args, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ddpkit: error:"), proc.stderr
    return lines[0]


def test_what_pp_cannot_do_is_one_line_exit_2(tmp_path):
    # before any worker starts
    assert "does not divide the 4 processes" in _refused(tmp_path, "--nproc", "4", "--pp", "3", "--save-every", "0")
    assert "use --strategy ddp" in _refused(
        tmp_path, "--nproc", "4", "--pp", "2", "--strategy", "fsdp", "--save-every", "0"
    )
    said = _refused(tmp_path, "--nproc", "2", "--pp", "2", "--snapshot-every-steps", "2")
    assert "--snapshot-every-steps with --pp 2: a pipeline's stages keep no snapshots" in said
    assert not (tmp_path / "r").exists()
    # in the workers, before the model trains: a model that cannot be cut
    line = _refused(tmp_path, "--nproc", "2", "--pp", "2", "--task-arg", "model=tied", "--save-every", "0")
    assert "shared across pipeline stages" in line
