"""Run log: every record goes to each metric sink the run asked for (reporting/sinks/:
metrics.jsonl always, metrics.csv, TensorBoard), written by rank 0 only, with the same
(already cross-rank) values."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

from ..util.textfile import read_own_text
from .sinks import MetricSink, ResumePoint, SinkSettings, wanted_sinks
from .sinks.base import FAILED, FINISHED, jsonl_path


class MetricsLog:
    """The open sinks of one run. `settings` are the run's (SinkSettings.of(cfg)): each sink
    class decides from its output section whether it is wanted; `csv` / `tensorboard` turn
    those two on for a caller that names them directly. `keep_until_epoch` / `keep_until_step` are where
    a resumed run continues: every sink drops what it holds after that point."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        enabled: bool,
        keep_until_epoch: int = 0,
        csv: bool = False,
        tensorboard: bool = False,
        keep_until_step: int | None = None,
        settings: SinkSettings | None = None,
    ) -> None:
        self.enabled = enabled
        self.sinks: list[MetricSink] = []
        if not enabled:
            return
        on = [name for name, wanted in (("csv", csv), ("tensorboard", tensorboard)) if wanted]
        settings = (settings or SinkSettings()).turned_on(*on)
        resume = ResumePoint(keep_until_epoch, keep_until_step)
        try:
            for cls in wanted_sinks(settings):
                sink = cls()
                sink.open(Path(run_dir), settings, resume)
                self.sinks.append(sink)
        except BaseException:
            self.close(FAILED)
            raise

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        for sink in self.sinks:
            sink.write(record, step)

    def close(self, ending: str = FINISHED) -> None:
        """Close every sink, telling each how the run ended (a tracker marks its run so)."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close(ending)

    def close_after_failure(self, ending: str = FAILED) -> None:
        """close(ending) on the way out of a failed run. When another rank failed too, torch's
        agent stops this worker with SIGTERM (which ends it at once) meanwhile, which would cut a
        tracker's last calls short and leave its run RUNNING: a SIGTERM is ignored until the sinks
        are closed (a tracker's wait is bounded; the agent kills the worker 30 s after its SIGTERM)."""
        if not self.sinks or threading.current_thread() is not threading.main_thread():
            self.close(ending)
            return
        # the run is ending with its own exception anyway: a SIGTERM meanwhile needs nothing more
        before = signal.signal(signal.SIGTERM, lambda signum, frame: None)
        try:
            self.close(ending)
        finally:
            signal.signal(signal.SIGTERM, before)


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The run's records (metrics.jsonl) for a reader such as `ddpkit plot`: a line that is not a
    JSON object with a numeric epoch (a crafted or damaged file, a line cut short by a kill) is
    not a record and is left out."""
    records = []
    for line in read_own_text(jsonl_path(run_dir)).splitlines():
        try:
            record = json.loads(line) if line.strip() else None
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("epoch"), (int, float)):
            records.append(record)
    return records
