"""`ddpkit runs [DIR]`: one line per run in a folder, from what each run directory holds
(config.json, summary.json, metrics.jsonl, failed.json, checkpoints/): its task, world size,
strategy, steps, final losses, how it ended and whether it can be resumed (from a checkpoint
whose every byte is as written: newer ones that are not are listed, with why)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from ..checkpoint.headers import newest_checked
from ..checkpoint.world_mark import rank0_gone
from ..errors import DdpkitError
from ..reporting.run_state import FAILED_FILE, end_killed_run, run_state
from ..reporting.summary import top_loss
from ..storage.copy import local_run
from ..storage.location import is_url
from ..util.textfile import read_own_text

WIDTH = 112  # the table fits a terminal this wide; long run and task names are shortened
COLUMNS = (
    ("run", "RUN"),
    ("task_short", "TASK"),
    ("world_size", "WORLD"),
    ("strategy", "STRATEGY"),
    ("steps", "STEPS"),
    ("train_loss", "TRAIN"),
    ("eval_loss", "EVAL"),
    ("compute_pct", "COMPUTE"),
    ("top_loss", "TOP LOSS"),
    ("state", "STATE"),
    ("resumable", "RESUME"),
)
RUN_FILES = ("config.json", "summary.json", "metrics.jsonl", FAILED_FILE, "checkpoints")


def main_runs(folder: str, as_json: bool) -> int:
    if is_url(folder):  # one run in a bucket: its files and newest committed checkpoint, downloaded
        with local_run(folder, checkpoint=True) as local:
            run = {**describe_run(local), "run": folder.rstrip("/").rsplit("/", 1)[-1], "path": folder}
            if run["checkpoint"]:  # its place in the bucket, not in the download
                run["checkpoint"] = folder.rstrip("/") + run["checkpoint"][len(str(local)) :]
            runs = [run]
    else:
        found = run_dirs(folder)
        for path in found:  # a run killed without a word: its tracker runs end here (one line each)
            said = end_killed_run(path)
            if said:
                print(f"ddpkit: {said}", file=sys.stderr, flush=True)
        runs = [describe_run(p) for p in found]
    if as_json:
        print(json.dumps(runs, indent=2))
    elif not runs:
        print(f"ddpkit: no runs in {folder}")
    else:
        print(format_table(runs))
    return 0


def run_dirs(folder: str | os.PathLike) -> list[Path]:
    """The run directories in `folder` (or `folder` itself when it is one), oldest start first."""
    root = Path(folder)
    if not root.is_dir():
        raise DdpkitError(f"{folder}: no such folder (runs go to runs/ by default, or where --run-dir said)")
    found = [root] if _is_run(root) else [p for p in root.iterdir() if p.is_dir() and _is_run(p)]
    return sorted(found, key=lambda p: (_started(p), p.name))


def _is_run(path: Path) -> bool:
    return any((path / name).exists() for name in RUN_FILES)


def _started(path: Path) -> float:
    for name in ("config.json", "metrics.jsonl"):
        if (path / name).exists():
            return (path / name).stat().st_mtime
    return path.stat().st_mtime


def describe_run(path: Path) -> dict[str, Any]:
    """Everything the table shows about one run, as plain values (the --json output)."""
    config = _json(path / "config.json") or {}
    ended = run_state(path)
    summary = ended.get("summary") or {}
    records = _records(path / "metrics.jsonl")
    newest, passed = newest_checked(path)  # reads every byte of the newest checkpoints: their CRC-32s
    world = _count(summary.get("world_size")) or (newest[1].world_size if newest else None)
    if world is None and _count(config.get("nproc")):
        world = config["nproc"] * _nodes(config.get("nnodes"))
    state = ended["state"]
    if state == "running?" and rank0_gone(path):  # no end recorded, and its rank 0 is known to be gone
        state = "killed"
    return {
        "run": path.name,
        "path": str(path),
        "task": _text(config.get("task")),
        "world_size": world,
        "strategy": _text(summary.get("strategy")) or _text(config.get("strategy")),
        "steps_done": _count(summary.get("steps_done", _last(records, "step"))),
        "steps_planned": _count(summary.get("steps_planned")) or _count(config.get("max_steps")),
        "epochs_done": _count(summary.get("epochs_done", _last(records, "epoch"))),
        "train_loss": _number(summary.get("train_loss", _last(records, "train_loss"))),
        "eval_loss": _number(summary.get("eval_loss", _last(records, "eval_loss"))),
        "time": _ledger(summary.get("time")),  # where the wall time went (the run's ledger), if it finished
        "state": state,
        "error": _text(ended.get("error")),
        "resumable": newest is not None,
        "checkpoint": str(newest[0]) if newest else None,
        "skipped_checkpoints": passed,  # newer ones a --resume passes over: damaged, cut short, foreign
    }


def format_table(runs: list[dict[str, Any]]) -> str:
    rows = [[_cell(key, run) for key, _ in COLUMNS] for run in runs]
    heads = [head for _, head in COLUMNS]
    widths = [max(len(r[i]) for r in [heads, *rows]) for i in range(len(COLUMNS))]
    excess = sum(widths) + 2 * (len(widths) - 1) - WIDTH
    for i in (1, 0):  # the task's name, then the run's, give way first
        cut = min(max(0, excess), widths[i] - len(heads[i]) - 2)
        widths[i] -= max(0, cut)
        excess -= max(0, cut)
    lines = ["  ".join(_fit(h, w) for h, w in zip(heads, widths, strict=True)).rstrip()]
    lines += ["  ".join(_fit(c, w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    failed = [f"  {run['run']}: {run['error']}" for run in runs if run["state"] == "failed" and run["error"]]
    skipped = [f"  {run['run']}: {why}" for run in runs for why in run["skipped_checkpoints"]]
    if failed:
        lines += ["failed:", *failed]
    if skipped:
        lines += ["checkpoints a --resume skips:", *skipped]
    return "\n".join(lines)


def _cell(key: str, run: dict[str, Any]) -> str:
    if key == "task_short":
        task = run["task"] or "-"
        if ":" in task:  # path/to/mytask.py:build -> mytask:build
            where, _, function = task.rpartition(":")
            task = f"{Path(where).stem}:{function}"
        return task
    if key == "steps":
        done, planned = run["steps_done"], run["steps_planned"]
        return "-" if done is None else f"{done}/{planned}" if planned else str(done)
    if key in ("train_loss", "eval_loss"):
        value = run[key]
        return "-" if value is None else f"{value:.4f}" if abs(value) < 100 else f"{value:.4g}"
    if key == "compute_pct":
        percent = (run.get("time") or {}).get("percent") or {}
        return f"{percent['compute']:.0f}%" if "compute" in percent else "-"
    if key == "top_loss":
        top = top_loss(run.get("time") or {})
        return f"{top[0]} {top[1]:.0f}%" if top else "-"
    if key == "resumable":
        return ("yes" if run["resumable"] else "no") + ("*" if run["skipped_checkpoints"] else "")
    value = run[key]
    return "-" if value is None else str(value)


def _fit(text: str, width: int) -> str:
    return text.ljust(width) if len(text) <= width else text[: max(1, width - 2)] + ".."


# A value of the wrong type (a crafted or damaged summary.json, config.json or metrics.jsonl) is
# shown as missing, never as if the run had recorded it.
def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return value if ok else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _ledger(value: Any) -> dict[str, Any] | None:
    """The summary's time ledger, with only its finite percentages."""
    if not isinstance(value, dict):
        return None
    percent = value.get("percent")
    percent = {k: v for k, v in percent.items() if _number(v) is not None} if isinstance(percent, dict) else {}
    return {**value, "percent": percent}


def _nodes(nnodes: Any) -> int:
    try:
        return int(str(nnodes).split(":")[-1])
    except ValueError:
        return 1


def _json(path: Path) -> dict[str, Any] | None:
    """The file's object; None when it is missing, damaged or not an object (a crafted folder)."""
    try:
        found = json.loads(read_own_text(path))
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _records(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's records; a line cut short by a crash is skipped."""
    try:
        lines = read_own_text(path).splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def _last(records: list[dict[str, Any]], key: str) -> Any:
    return next((r[key] for r in reversed(records) if r.get(key) is not None), None)
