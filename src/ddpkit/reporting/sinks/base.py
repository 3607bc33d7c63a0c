"""What every metric sink is: opened once per run with its settings (SinkSettings: the output
section, whether the run resumes, what a tracker records of it) and the point it resumes
from, handed each record (already reduced across ranks) with its global step, closed at the
end. Only rank 0 opens sinks; MetricsLog (reporting/metrics.py) drives them."""

from __future__ import annotations

import abc
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Mapping

from ...config.output import Output
from ...util.envvars import RUN_URL_VAR

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


@dataclass(frozen=True)
class SinkSettings:
    """What a sink is told of its run: the output section (which sinks, --quiet, a tracker's
    server and experiment), whether the run resumes (a tracker then continues the run it
    started), and what a tracker records of the run: every setting (`config`, RunConfig.as_dict())
    and the world size it ran at; `params` are the two together, a tracker's parameters."""

    output: Output = field(default_factory=Output)
    resuming: bool = False  # --resume or --auto-resume
    config: Mapping[str, Any] = field(default_factory=dict)
    world_size: int | None = None

    @classmethod
    def of(cls, cfg: Any, world_size: int | None = None) -> SinkSettings:
        """A RunConfig's, for a run at `world_size` processes."""
        config = cfg.as_dict()
        if os.environ.get(RUN_URL_VAR):  # the run folder is a bucket's staging copy: the run is at the URL
            config["run_dir"] = os.environ[RUN_URL_VAR]
        return cls(cfg.output, bool(cfg.resume or cfg.auto_resume), config, world_size)

    @property
    def params(self) -> dict[str, Any]:
        """Every setting and the world size: what a tracker logs as the run's parameters."""
        return {**self.config, **({} if self.world_size is None else {"world_size": self.world_size})}

    def turned_on(self, *names: str) -> SinkSettings:
        """These settings with the sinks `names` (csv, tensorboard) on, as their flags would."""
        return replace(self, output=replace(self.output, **{name: True for name in names}))


class MetricSink(abc.ABC):
    """One place a run's metrics go. A new sink (a tracker) is a subclass in its own file
    under reporting/sinks/ and one entry of SINKS there."""

    name: ClassVar[str]

    @classmethod
    def wanted(cls, settings: SinkSettings) -> bool:
        """Whether the run's output section asks for this sink: by its own setting (--csv) or
        as a --tracker."""
        return getattr(settings.output, cls.name, None) is True or cls.name in settings.output.tracker

    @abc.abstractmethod
    def open(self, run_dir: Path, settings: SinkSettings, resume: ResumePoint) -> None:
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
