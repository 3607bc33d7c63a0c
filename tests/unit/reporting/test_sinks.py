"""The sinks are one protocol: MetricsLog opens the ones a run's settings ask for, in SINKS's
order, hands each record with its global step, and closes them; a new sink is one class."""

from pathlib import Path

import pytest

from ddpkit import RunConfig
from ddpkit.reporting import sinks
from ddpkit.reporting.metrics import MetricsLog
from ddpkit.reporting.sinks import SINKS, MetricSink, ResumePoint, SinkSettings, wanted_sinks


class Recorder(MetricSink):
    """A tracker as a user would add one: told the settings and resume point, then every record."""

    name = "recorder"
    events: list = []

    @classmethod
    def wanted(cls, settings):  # a sink of its own, on for every run (a tracker: a --tracker choice)
        return True

    def open(self, run_dir, settings, resume):
        self.events.append(("open", Path(run_dir), settings.params["epochs"], resume))

    def write(self, record, global_step):
        self.events.append(("write", record["epoch"], global_step))

    def close(self, ending="finished"):
        self.events.append(("close", ending))


def test_the_settings_choose_the_sinks():
    names = lambda cfg: [cls.name for cls in wanted_sinks(SinkSettings.of(cfg))]  # noqa: E731
    assert names(RunConfig()) == ["jsonl"]
    assert names(RunConfig(csv=True, tensorboard=True)) == ["jsonl", "csv", "tensorboard"]
    assert [cls.name for cls in SINKS][0] == "jsonl"  # first: the others may read it back


def test_a_new_sink_is_one_class_in_the_list(tmp_path, monkeypatch):
    monkeypatch.setattr(sinks, "SINKS", (*SINKS, Recorder))
    Recorder.events = []
    settings = SinkSettings.of(RunConfig(epochs=7))
    log = MetricsLog(tmp_path, enabled=True, keep_until_epoch=2, keep_until_step=20, settings=settings)
    log.write({"epoch": 3, "step": 30, "train_loss": 0.5})
    log.write({"epoch": 4, "train_loss": 0.25})  # a record without a step
    log.close("stopped")
    assert Recorder.events == [
        ("open", tmp_path, 7, ResumePoint(2, 20)),
        ("write", 3, 30),
        ("write", 4, None),
        ("close", "stopped"),  # how the run ended: a tracker marks its run so
    ]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_a_sink_that_fails_to_open_closes_those_already_open(tmp_path, monkeypatch):
    class Broken(Recorder):
        name = "broken"

        def open(self, run_dir, settings, resume):
            raise OSError("tracker unreachable")

    monkeypatch.setattr(sinks, "SINKS", (Recorder, Broken))
    Recorder.events = []
    with pytest.raises(OSError, match="unreachable"):
        MetricsLog(tmp_path, enabled=True, settings=SinkSettings.of(RunConfig(epochs=1)))
    assert Recorder.events[-1] == ("close", "failed")


def test_the_resume_point_keeps_whole_epochs_and_steps_inside_the_next():
    at = ResumePoint(epoch=2, step=10)
    assert at.keeps({"epoch": 2, "step": 8}) and at.keeps({"epoch": 3, "step": 10})
    assert not at.keeps({"epoch": 3, "step": 11}) and not at.keeps({"epoch": 3})
    assert not ResumePoint().keeps({"epoch": 1})
