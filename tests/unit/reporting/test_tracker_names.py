"""Tracker names and their packages are declared once (config.output.TRACKERS): every sink but
metrics.jsonl is a --tracker choice, and a tracker imports the package --tracker's check asks for."""

from ddpkit.config.output import TRACKERS
from ddpkit.reporting.sinks import SINKS, Tracker


def test_every_sink_but_metrics_jsonl_is_a_tracker_choice_and_every_choice_a_sink():
    assert {cls.name for cls in SINKS} - {"jsonl"} == set(TRACKERS)


def test_a_tracker_needs_the_package_its_choice_names():
    trackers = [cls for cls in SINKS if issubclass(cls, Tracker)]
    assert trackers and all(cls.package == TRACKERS[cls.name] for cls in trackers)
