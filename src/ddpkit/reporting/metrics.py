"""Run log: metrics.jsonl (one JSON object per epoch), written by rank 0 only; optionally
also metrics.csv and TensorBoard event files with the same (already cross-rank) values."""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any


class MetricsLog:
    def __init__(self, run_dir: str | os.PathLike, enabled: bool, keep_until_epoch: int = 0,
                 csv: bool = False, tensorboard: bool = False, keep_until_step: int | None = None) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self._sinks: list[Any] = []
        if enabled:
            self._truncate_after(keep_until_epoch, keep_until_step)
            if csv:
                self._sinks.append(CsvLog(Path(run_dir) / "metrics.csv", read_metrics(run_dir) if self.path.exists() else []))
            if tensorboard:
                self._sinks.append(TensorBoardLog(Path(run_dir) / "tensorboard", resume_after_epoch=keep_until_epoch))

    def _truncate_after(self, epoch: int, step: int | None = None) -> None:
        """On resume, drop lines of epochs (and, given `step`, of optimizer steps) the
        checkpoint does not contain: they will be redone."""
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
                if record.get("epoch", 0) <= epoch or (step is not None and record.get("step", step + 1) <= step):
                    kept.append(line)
            except json.JSONDecodeError:
                continue
        self.path.write_text("".join(k + "\n" for k in kept))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for sink in self._sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()
        self._sinks = []


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class CsvLog:
    """metrics.csv, one row per epoch. Columns are the keys seen so far; when a new one
    appears (the first eval after --eval-every epochs) the file is rewritten with it."""

    def __init__(self, path: Path, records: list[dict[str, Any]]) -> None:
        self.path = path
        self.records = list(records)
        self.columns: list[str] = []
        self._rewrite()

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
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

    def close(self) -> None:
        pass


class TensorBoardLog:
    """TensorBoard scalars, step = epoch: loss/train, loss/eval, eval/<metric>, perf/... .
    On resume, events after the checkpoint's epoch from the interrupted run are dropped."""

    TAGS = {"train_loss": "loss/train", "eval_loss": "loss/eval", "samples_per_s": "perf/samples_per_s",
            "epoch_s": "perf/epoch_s", "lr": "optim/lr"}

    def __init__(self, log_dir: Path, resume_after_epoch: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = resume_after_epoch + 1 if resume_after_epoch else None
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)

    def write(self, record: dict[str, Any]) -> None:
        step = record["epoch"]
        for key, value in record.items():
            if key == "epoch" or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            tag = self.TAGS.get(key) or (f"eval/{key[5:]}" if key.startswith("eval_") else f"run/{key}")
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
