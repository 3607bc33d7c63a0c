"""How a run ended, read from its folder: rank 0 writes config.json when an attempt starts and
summary.json when it ends; the launcher writes failed.json when it fails. The newest attempt
is the one whose config.json is on disk: an end record older than it belongs to an earlier one."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

from ..checkpoint.world_mark import rank0_gone, started_by_this_launch
from ..errors import DdpkitError, RunDirTaken
from ..util.textfile import read_own_text, write_text_atomic

FAILED_FILE = "failed.json"
STATES = ("finished", "stopped", "interrupted", "failed", "running?")
TRACKER_NAMES = {"mlflow": "MLflow", "wandb": "W&B"}


def stopped_by(error: BaseException) -> str | None:
    """The signal's name when `error` is a run being stopped by one (Ctrl-C, a TERM from a
    scheduler or `kill`) rather than failing: KeyboardInterrupt, an error that carries the
    signal's number, or the launcher's "stopped by SIGNAME" line. None for a failure."""
    signum = getattr(error, "signum", None)
    if isinstance(signum, int):
        try:
            return signal.Signals(signum).name
        except ValueError:
            return f"signal {signum}"
    if isinstance(error, KeyboardInterrupt):
        return "SIGINT"
    said = re.match(r"stopped by (SIG[A-Z0-9]+)\b", str(error))
    return said.group(1) if said else None


def record_failure(run_dir: str | os.PathLike, error: BaseException, rank: int | None = None) -> None:
    """Say in the run's folder that its attempt failed, and why (one line), for `ddpkit runs`.
    Only for an attempt of this launch that started (the folder's mark is this launch's,
    world_mark.py): a refusal before the start leaves an earlier run in that folder as it was.
    The first record of an attempt stays: the worker that failed writes its own error before
    the launcher learns that one did. A world
    that stopped because another took its folder over records nothing: the attempt in that
    folder is the other world's, and it is not failing."""
    if isinstance(error, RunDirTaken):
        return
    folder = Path(run_dir)
    start = _mtime(folder / "config.json")
    if start < 0 or _mtime(folder / FAILED_FILE) >= start or not started_by_this_launch(folder):
        return
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    message = first if isinstance(error, DdpkitError) else f"{type(error).__name__}: {first}".rstrip(": ")
    if rank is not None:
        message = f"rank {rank}: {message}"
    record = {"error": message[:500], "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    signal_name = stopped_by(error)
    if signal_name:  # not a failure: a user or a scheduler stopped it (no --save-on-signal checkpoint)
        record = {"error": f"stopped by {signal_name}", "interrupted": signal_name, "time": record["time"]}
    try:
        write_text_atomic(folder / FAILED_FILE, json.dumps(record, indent=2) + "\n")
    except OSError:
        pass  # the run's own error is what the user needs to see, not this one


def run_state(run_dir: str | os.PathLike) -> dict[str, Any]:
    """{"state": finished | stopped | interrupted | failed | running?, "summary": ..., "error": ...}
    of the newest attempt. stopped: by a --save-on-signal signal, with a checkpoint at that step;
    interrupted: by a signal without one (Ctrl-C, a TERM); running?: no end was recorded: still
    running, or killed without a word (SIGKILL, a lost node)."""
    folder = Path(run_dir)
    start = _mtime(folder / "config.json")
    summary = _read(folder / "summary.json") if _mtime(folder / "summary.json") >= start else None
    if isinstance(summary, dict):
        return {"state": "stopped" if summary.get("stopped_early") else "finished", "summary": summary}
    failed = _read(folder / FAILED_FILE) if _mtime(folder / FAILED_FILE) >= start else None
    if isinstance(failed, dict):
        return {"state": "interrupted" if failed.get("interrupted") else "failed", "error": failed.get("error")}
    return {"state": "running?"}


def end_killed_run(run_dir: str | os.PathLike) -> str | None:
    """A run killed without a word (SIGKILL of its launcher, the kernel's OOM killer) could end
    none of the tracker runs it started, and MLflow would show it RUNNING forever. Once nothing
    recorded its end and its rank 0 is known to be gone (world_mark.rank0_gone: its host, its
    pid), the tracker runs it left running are marked KILLED, MLflow's status for a run stopped
    before its end. The line that says so, or None when there was nothing to mark."""
    if run_state(run_dir)["state"] != "running?" or not rank0_gone(run_dir):
        return None
    from .sinks import end_abandoned_trackers
    from .sinks.base import STOPPED

    marked = end_abandoned_trackers(run_dir, STOPPED, running_only=True)
    if not marked:
        return None
    names = " and ".join(TRACKER_NAMES.get(name, name) for name in marked)
    many = "runs" if len(marked) > 1 else "run"
    return f"{run_dir}: killed without a word (its rank 0 is gone); its {names} {many}, left RUNNING, is marked KILLED"


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return -1.0


def _read(path: Path) -> Any:
    try:
        return json.loads(read_own_text(path))
    except (OSError, ValueError):
        return None
