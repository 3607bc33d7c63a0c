"""metrics.jsonl: one JSON object per record, always written; the run's own log that plots,
retention (--keep-best) and the other sinks read back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from .base import MetricSink, ResumePoint, SinkSettings, jsonl_path


class JsonlSink(MetricSink):
    name = "jsonl"

    @classmethod
    def wanted(cls, settings: SinkSettings) -> bool:
        return True

    def open(self, run_dir: Path, settings: SinkSettings, resume: ResumePoint) -> None:
        self.path = jsonl_path(run_dir)
        if self.path.exists():  # a resume: drop the lines of epochs (and steps) the checkpoint does not hold
            kept = []
            for line in self.path.read_text().splitlines():
                try:
                    if resume.keeps(json.loads(line)):
                        kept.append(line)
                except json.JSONDecodeError:
                    continue
            self.path.write_text("".join(k + "\n" for k in kept))

    def write(self, record: Mapping[str, Any], global_step: int | None) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
