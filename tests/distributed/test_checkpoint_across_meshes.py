"""Checkpoints under --tp and --pp, resumed on another mesh, through the real CLI (gloo, CPU).

The two-block GPT of separate q/k/v (tp_task.py: float64, SGD with momentum, so the
optimizer state must travel too) trains 12 steps of a global batch of 8 (3 an epoch, 4 epochs).
A run stopped after 8 steps (--max-steps 8: mid-epoch, its data position in samples) and resumed
to the end must give the uninterrupted one-process run's weights and losses within 1e-6:
  * saved under FSDP x TP (2x2, the Linears' DTensor pieces sharded over dp), resumed under
    DDP x PP (2 pipelines of 2 stages): DCP reshards the split Linears into each stage's part;
  * saved by a 2-stage pipeline, resumed by the same pipeline, and a copy resumed under FSDP x TP.
A stage writes its part of the model and optimizer under the whole model's names: the checkpoint
holds every parameter and its momentum once, as a one-process run's would, with a CRC-32 for
every file, and `ddpkit export` of a pipeline's checkpoint gives the whole weights. One reference
run serves both tests."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import REPO, assert_state_close, load_model, run_ddpkit

TASK = str(REPO / "tests" / "distributed" / "scripts" / "tp_task.py") + ":build"
COMMON = ["--seed", "7", "--threads", "1", "--quiet", "--epochs", "4", "--batch-size", "4"]
COMMON += ["--global-batch-size", "8", "--task-arg", "samples=24", "--task-arg", "momentum=0.9"]
FSDP_X_TP = ("--nproc", "4", "--strategy", "fsdp", "--tp", "2")
DDP_X_PP = ("--nproc", "4", "--pp", "2")
PIPELINE = ("--nproc", "2", "--pp", "2", "--batch-size", "8")  # 2 stages, one pipeline: no accumulation
MIDWAY = "epoch-000002-step-000008"  # 2 epochs of 3 steps, then 2 of the third's: 16 of its 24 samples
TOL = 1e-6


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _train(run, *args):
    return run_ddpkit("train", TASK, *COMMON, *args, "--run-dir", str(run))


def _same(run, one):
    """The whole weights and every evaluation (each epoch's and the stop's at step 8) as one process."""
    assert_state_close(load_model(run), load_model(one), rtol=0, atol=TOL)
    whole = {r["step"]: r for r in _records(one)}
    records = _records(run)
    assert [r["step"] for r in records] == [3, 6, 8, 9, 12]  # one pass each, the stop at 8 in between
    for r in records:
        if r["step"] in whole:  # the resumed epoch's train loss too: the stop's loss sums were carried
            for key in ("train_loss", "eval_loss"):
                assert abs(r[key] - whole[r["step"]][key]) < TOL, (key, r, whole[r["step"]])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps_done"] == 12 and abs(summary["eval_loss"] - whole[12]["eval_loss"]) < TOL


def _stopped_at_8(run):
    """The run stopped after 8 steps wrote one checkpoint, mid-epoch, complete and as written."""
    from ddpkit.checkpoint.sharded import read_complete

    folders = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert folders == [MIDWAY], folders
    return read_complete(run / "checkpoints" / MIDWAY)  # every file's size and CRC-32 checked


@pytest.fixture(scope="module")
def one_process(reference_run):
    return reference_run(TASK, *COMMON, "--nproc", "1", "--save-every", "0")


@pytest.mark.slow
def test_8_steps_on_fsdp_x_tp_then_resume_on_ddp_x_pp_equals_one_process(one_process, tmp_path):
    run = tmp_path / "run"
    _train(run, *FSDP_X_TP, "--max-steps", "8")
    meta = _stopped_at_8(run)
    assert meta["world_size"] == 4 and meta["global_step"] == 8
    _train(run, *DDP_X_PP, "--resume")
    _same(run, one_process)


@pytest.mark.slow
def test_a_pipeline_saved_midway_resumes_on_itself_and_on_fsdp_x_tp(one_process, tmp_path):
    from ddpkit.checkpoint.dcp_io import folder_metadata, load_into

    run = tmp_path / "pp"
    _train(run, *PIPELINE, "--max-steps", "8")
    _stopped_at_8(run)
    # mesh-independent: each stage wrote its part under the whole model's names, the two stages
    # together every weight and every momentum buffer, as a one-process checkpoint names them
    names = set(folder_metadata(run / "checkpoints" / MIDWAY).state_dict_metadata)
    whole = load_model(one_process).keys()
    assert {n[len("model.") :] for n in names if n.startswith("model.")} == set(whole)
    assert {f"optim.state.{k}.momentum_buffer" for k in whole} <= names
    # its optimizer group lists every parameter (DCP keeps one rank's copy of it): a stage's own
    # list would leave the other stage's parameters without the group's momentum on resume
    groups = {"optim": {"param_groups": [{"params": [], "momentum": 0.0}]}}
    load_into(groups, run / "checkpoints" / MIDWAY, no_dist=True)
    (group,) = groups["optim"]["param_groups"]
    assert sorted(group["params"]) == sorted(whole) and group["momentum"] == 0.9
    other = tmp_path / "tp"
    shutil.copytree(run, other)
    _train(run, *PIPELINE, "--resume")
    _same(run, one_process)
    # ddpkit export of the pipeline's last checkpoint (read tensor by tensor): the whole model's weights
    from safetensors.torch import load_file

    run_ddpkit("export", str(run), "--checkpoint", "epoch-000004", "--out", str(tmp_path / "export"))
    assert_state_close(load_file(str(tmp_path / "export" / "model.safetensors")), load_model(one_process), 0, TOL)
    _train(other, *FSDP_X_TP, "--resume")
    _same(other, one_process)
