"""metrics.csv (--csv): one row per record. Columns are the keys seen so far; when a new one
appears (the first eval after --eval-every epochs) the file is rewritten with it."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Mapping

from .base import MetricSink, ResumePoint, SinkSettings, jsonl_path, read_jsonl


class CsvSink(MetricSink):
    name = "csv"

    def open(self, run_dir: Path, settings: SinkSettings, resume: ResumePoint) -> None:
        self.path = Path(run_dir) / "metrics.csv"
        old = jsonl_path(run_dir)  # on resume the table is rebuilt from the records the checkpoint holds
        self.records = [r for r in read_jsonl(old) if resume.keeps(r)] if old.exists() else []
        self.columns: list[str] = []
        self._rewrite()

    def write(self, record: Mapping[str, Any], global_step: int | None) -> None:
        self.records.append(dict(record))
        if set(record) - set(self.columns):
            self._rewrite()
            return
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, self.columns).writerow(record)

    def _rewrite(self) -> None:
        self.columns = list(dict.fromkeys(k for r in self.records for k in r))
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, self.columns)
            if self.columns:
                w.writeheader()
            w.writerows(self.records)
