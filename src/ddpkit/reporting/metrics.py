"""Run log: every record goes to each metric sink the run asked for (reporting/sinks/:
metrics.jsonl always, metrics.csv, TensorBoard), written by rank 0 only, with the same
(already cross-rank) values."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from .sinks import MetricSink, ResumePoint, wanted_sinks
from .sinks.base import jsonl_path


class MetricsLog:
    """The open sinks of one run. `settings` are the run's (RunConfig.as_dict()): each sink
    class decides from them whether it is wanted; `csv` / `tensorboard` turn those two on
    for a caller that names them directly. `keep_until_epoch` / `keep_until_step` are where
    a resumed run continues: every sink drops what it holds after that point."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        enabled: bool,
        keep_until_epoch: int = 0,
        csv: bool = False,
        tensorboard: bool = False,
        keep_until_step: int | None = None,
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        self.enabled = enabled
        self.sinks: list[MetricSink] = []
        if not enabled:
            return
        settings = {**(settings or {}), **{k: True for k, on in (("csv", csv), ("tensorboard", tensorboard)) if on}}
        resume = ResumePoint(keep_until_epoch, keep_until_step)
        try:
            for cls in wanted_sinks(settings):
                sink = cls()
                sink.open(Path(run_dir), settings, resume)
                self.sinks.append(sink)
        except BaseException:
            self.close()
            raise

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        for sink in self.sinks:
            sink.write(record, step)

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    return [json.loads(line) for line in jsonl_path(run_dir).read_text().splitlines() if line.strip()]
