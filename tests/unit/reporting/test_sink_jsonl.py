"""metrics.jsonl: every record one line, and on resume only the records the checkpoint holds."""

import json

from ddpkit.reporting.sinks import JsonlSink, ResumePoint, SinkSettings

FRESH = ResumePoint()  # a run that resumes from nothing


def _write(run_dir, records, resume=FRESH):
    sink = JsonlSink()
    sink.open(run_dir, SinkSettings(), resume)
    for r in records:
        sink.write(r, r.get("step"))
    sink.close()


def _lines(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_each_record_is_one_json_line_in_order(tmp_path):
    records = [
        {"epoch": 1, "step": 4, "train_loss": 0.5},
        {"epoch": 2, "step": 8, "train_loss": 0.25, "eval_loss": 0.3},
    ]
    _write(tmp_path, records)
    assert _lines(tmp_path) == records


def test_a_resume_drops_the_epochs_after_the_checkpoint(tmp_path):
    _write(tmp_path, [{"epoch": e, "step": 4 * e} for e in (1, 2, 3)])
    _write(tmp_path, [{"epoch": 3, "step": 12, "redone": True}], ResumePoint(epoch=2))
    assert _lines(tmp_path) == [
        {"epoch": 1, "step": 4},
        {"epoch": 2, "step": 8},
        {"epoch": 3, "step": 12, "redone": True},
    ]


def test_a_resume_inside_an_epoch_keeps_the_evaluations_up_to_its_step(tmp_path):
    # epoch 3 evaluated at steps 10 and 11 (--eval-every-steps), then the run died; the checkpoint holds step 10
    _write(
        tmp_path, [{"epoch": 1, "step": 4}, {"epoch": 2, "step": 8}, {"epoch": 3, "step": 10}, {"epoch": 3, "step": 11}]
    )
    _write(tmp_path, [], ResumePoint(epoch=2, step=10))
    assert [r["step"] for r in _lines(tmp_path)] == [4, 8, 10]


def test_a_line_cut_short_by_a_crash_is_dropped_on_resume(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1}\n{"epoch": 2, "tra')
    _write(tmp_path, [], ResumePoint(epoch=5))
    assert _lines(tmp_path) == [{"epoch": 1}]
