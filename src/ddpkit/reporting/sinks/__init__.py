"""Where a run's metrics go: one MetricSink class per place, listed in SINKS. A new sink (a
tracker such as MLflow or W&B) is a file here with its class, one entry below, a setting of
the output section (config/output.py) named like the sink that turns it on (or a --tracker
choice: its name and package in TRACKERS there, the one list of them), and its test in
tests/unit/reporting/."""

from __future__ import annotations

import os
from pathlib import Path

from .base import MetricSink, ResumePoint, SinkSettings, read_jsonl
from .csvfile import CsvSink
from .jsonl import JsonlSink
from .mlflow_tracker import MlflowSink
from .tensorboard import TensorBoardSink
from .tracker import Tracker
from .wandb_tracker import WandbSink

# metrics.jsonl first: the others may read it back
SINKS: tuple[type[MetricSink], ...] = (JsonlSink, CsvSink, TensorBoardSink, MlflowSink, WandbSink)


def wanted_sinks(settings: SinkSettings) -> list[type[MetricSink]]:
    """The sink classes a run's output section turns on, in SINKS's order."""
    return [cls for cls in SINKS if cls.wanted(settings)]


def end_abandoned_trackers(run_dir: str | os.PathLike, ending: str, running_only: bool = False) -> list[str]:
    """After a run failed or was stopped and every worker is gone: mark the tracker runs its
    rank 0 left running (it was killed: a signal, out of memory) as `ending`. The names of
    those it marked. Only trackers that started a run (their RUN_DIR/tracker-NAME.json).
    `running_only`: leave a tracker run that already ended as it is (a run killed without a
    word, found later: its own end, if it wrote one, is the truth)."""
    return [
        cls.name
        for cls in SINKS
        if issubclass(cls, Tracker)
        and (Path(run_dir) / f"tracker-{cls.name}.json").is_file()
        and cls.end_abandoned(Path(run_dir), ending, running_only)
    ]


__all__ = [
    "SINKS",
    "CsvSink",
    "JsonlSink",
    "MetricSink",
    "MlflowSink",
    "ResumePoint",
    "SinkSettings",
    "TensorBoardSink",
    "Tracker",
    "WandbSink",
    "end_abandoned_trackers",
    "read_jsonl",
    "wanted_sinks",
]
