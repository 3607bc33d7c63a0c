"""Run log: metrics.jsonl (one JSON object per epoch), written by rank 0 only."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class MetricsLog:
    def __init__(self, run_dir: str | os.PathLike, enabled: bool, keep_until_epoch: int = 0) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        if enabled:
            self._truncate_after(keep_until_epoch)

    def _truncate_after(self, epoch: int) -> None:
        """On resume, drop lines of epochs the checkpoint does not contain (they will be redone)."""
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("epoch", 0) <= epoch:
                    kept.append(line)
            except json.JSONDecodeError:
                continue
        self.path.write_text("".join(k + "\n" for k in kept))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
