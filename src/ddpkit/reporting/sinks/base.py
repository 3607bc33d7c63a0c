"""What every metric sink is: opened once per run with the run's settings and the point it
resumes from, handed each record (already reduced across ranks) with its global step, closed
at the end. Only rank 0 opens sinks; MetricsLog (reporting/metrics.py) drives them."""

from __future__ import annotations

import abc
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Mapping

JSONL_NAME = "metrics.jsonl"

# How a run ended, as its sinks are told when they close: a tracker marks its run so (MLflow's
# status, W&B's exit code). STOPPED: by a signal (Ctrl-C, or --save-on-signal's checkpoint and stop).
FINISHED, STOPPED, FAILED = "finished", "stopped", "failed"


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run continues: records after it are redone, so every sink drops what it
    holds of them. A fresh run is ResumePoint() and keeps nothing old."""

    epoch: int = 0  # epochs the checkpoint holds
    step: int | None = None  # optimizer steps it holds; None: whole epochs only

    def keeps(self, record: Mapping[str, Any]) -> bool:
        """Whether an old record is part of what the checkpoint holds (a step-based evaluation
        inside an unfinished epoch counts by its step)."""
        step = self.step
        return record.get("epoch", 0) <= self.epoch or (step is not None and record.get("step", step + 1) <= step)


class MetricSink(abc.ABC):
    """One place a run's metrics go. A new sink (a tracker) is a subclass in its own file
    under reporting/sinks/ and one entry of SINKS there."""

    name: ClassVar[str]

    @classmethod
    def wanted(cls, settings: Mapping[str, Any]) -> bool:
        """Whether the run's settings (RunConfig.as_dict()) ask for this sink: by its own
        setting (--csv) or as a --tracker."""
        return bool(settings.get(cls.name)) or cls.name in (settings.get("tracker") or ())

    @abc.abstractmethod
    def open(self, run_dir: Path, settings: Mapping[str, Any], resume: ResumePoint) -> None:
        """Start writing into `run_dir`, dropping what was written after `resume`."""

    @abc.abstractmethod
    def write(self, record: Mapping[str, Any], global_step: int | None) -> None:
        """One record (an epoch's, or a step-based evaluation's); `global_step` is the run's
        optimizer steps so far (None when the record has none)."""

    def close(self, ending: str = FINISHED) -> None:  # noqa: B027  (not abstract: nothing to release, nothing here)
        """Flush and release what open() took (called once, also after a failure: `ending`
        says how the run ended, FINISHED, STOPPED or FAILED)."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, skipping a line cut short by a crash."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def jsonl_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / JSONL_NAME
