"""TensorBoard: the records' numbers as scalars at the optimizer step (as MLflow and W&B), an
evaluation inside an epoch at its own step; on resume the redone steps are purged."""

import pytest

from ddpkit.reporting.sinks import ResumePoint, SinkSettings, TensorBoardSink

tb = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")  # the [tensorboard] extra

FRESH = ResumePoint()  # a run that resumes from nothing


def _write(run_dir, records, resume=FRESH):
    sink = TensorBoardSink()
    sink.open(run_dir, SinkSettings().turned_on("tensorboard"), resume)
    for r in records:
        sink.write(r, r.get("step"))
    sink.close()
    acc = tb.EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return acc


def test_each_number_is_a_tagged_scalar_at_its_optimizer_step(tmp_path):
    acc = _write(
        tmp_path,
        [
            {"epoch": 1, "step": 3, "eval_loss": 0.4},  # an evaluation inside epoch 1 (--eval-every-steps)
            {"epoch": 1, "step": 5, "train_loss": 0.5, "lr": 0.1, "note": "text", "stopped": True},
            {"epoch": 2, "step": 10, "train_loss": 0.25, "eval_loss": 0.3, "eval_accuracy": 0.75},
        ],
    )
    assert set(acc.Tags()["scalars"]) == {"loss/train", "optim/lr", "run/epoch", "loss/eval", "eval/accuracy"}
    assert [(e.step, e.value) for e in acc.Scalars("loss/train")] == [(5, 0.5), (10, 0.25)]
    assert [(e.step, e.value) for e in acc.Scalars("loss/eval")] == [(3, pytest.approx(0.4)), (10, pytest.approx(0.3))]
    assert [(e.step, e.value) for e in acc.Scalars("eval/accuracy")] == [(10, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("run/epoch")] == [(3, 1), (5, 1), (10, 2)]


def test_a_resume_purges_the_steps_after_the_checkpoint(tmp_path):
    _write(tmp_path, [{"epoch": e, "step": 4 * e, "train_loss": 1.0 / e} for e in (1, 2, 3)])
    acc = _write(tmp_path, [{"epoch": 3, "step": 12, "train_loss": 0.3}], ResumePoint(epoch=2, step=8))
    assert [(e.step, e.value) for e in acc.Scalars("loss/train")] == [(4, 1.0), (8, 0.5), (12, pytest.approx(0.3))]


def test_records_without_a_step_are_at_their_epoch(tmp_path):
    _write(tmp_path, [{"epoch": e, "train_loss": 1.0 / e} for e in (1, 2, 3)])
    acc = _write(tmp_path, [{"epoch": 3, "train_loss": 0.3}], ResumePoint(epoch=2))
    assert [(e.step, e.value) for e in acc.Scalars("loss/train")] == [(1, 1.0), (2, 0.5), (3, pytest.approx(0.3))]
