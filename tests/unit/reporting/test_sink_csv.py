"""metrics.csv: a column for every key seen, and on resume the table of the records kept."""

from ddpkit import RunConfig
from ddpkit.reporting.sinks import CsvSink, JsonlSink, ResumePoint, SinkSettings

FRESH = ResumePoint()  # a run that resumes from nothing


def _run(run_dir, records, resume=FRESH):
    sinks = [JsonlSink(), CsvSink()]  # the csv is rebuilt from metrics.jsonl on resume, as MetricsLog opens them
    for s in sinks:
        s.open(run_dir, SinkSettings().turned_on("csv"), resume)
    for r in records:
        for s in sinks:
            s.write(r, r.get("step"))
    for s in sinks:
        s.close()
    return (run_dir / "metrics.csv").read_text().splitlines()


def test_a_new_key_rewrites_the_table_with_its_column(tmp_path):
    rows = _run(
        tmp_path,
        [
            {"epoch": 1, "train_loss": 0.5},
            {"epoch": 2, "train_loss": 0.25, "eval_loss": 0.3},
            {"epoch": 3, "train_loss": 0.125},
        ],
    )
    assert rows == ["epoch,train_loss,eval_loss", "1,0.5,", "2,0.25,0.3", "3,0.125,"]


def test_a_resume_keeps_the_rows_the_checkpoint_holds(tmp_path):
    _run(tmp_path, [{"epoch": e, "step": 2 * e, "train_loss": 1.0 / e} for e in (1, 2, 3)])
    rows = _run(tmp_path, [{"epoch": 3, "step": 6, "train_loss": 0.3}], ResumePoint(epoch=2, step=4))
    assert rows == ["epoch,step,train_loss", "1,2,1.0", "2,4,0.5", "3,6,0.3"]


def test_wanted_only_with_the_csv_setting():
    assert CsvSink.wanted(SinkSettings().turned_on("csv")) and not CsvSink.wanted(SinkSettings())
    assert CsvSink.wanted(SinkSettings.of(RunConfig(tracker=["csv"])))
