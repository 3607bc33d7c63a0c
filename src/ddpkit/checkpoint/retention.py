"""--keep-last K and --keep-best B: which complete checkpoints stay. Older ones are deleted
only after a newer one is complete (renamed into place), so a crash mid-save never leaves
fewer than K; a crash between the rename and the deletion leaves K+1, pruned at the next
save or resume. Temporaries of an interrupted save (.tmp files, .partial folders) are never
counted. --keep-best B also keeps the B checkpoints with the best --best-metric (recorded in
checkpoints/metrics.json when each is written) and always the newest, to resume from."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..util.textfile import write_text_atomic
from .file import CKPT_DIR, list_checkpoints

METRICS = "metrics.json"  # checkpoint name -> its --best-metric value


def all_checkpoints(run_dir: str | os.PathLike) -> list[tuple[tuple[int, int], Path]]:
    """((epoch, step), path) of every complete checkpoint of either kind, newest first."""
    from .sharded import list_sharded  # torch.distributed.checkpoint: ~0.5 s to import, only when needed

    return sorted(list_checkpoints(run_dir) + list_sharded(run_dir), reverse=True)


def record_metric(run_dir: str | os.PathLike, name: str, value: float) -> None:
    """Remember the --best-metric value of the checkpoint `name` (epoch-000004, either kind)."""
    path = Path(run_dir) / CKPT_DIR / METRICS
    known = _metrics(run_dir)
    known[name] = float(value)
    write_text_atomic(path, json.dumps(known, indent=1))


def _metrics(run_dir: str | os.PathLike) -> dict[str, float]:
    try:
        return json.loads((Path(run_dir) / CKPT_DIR / METRICS).read_text())
    except (OSError, ValueError):
        return {}


def prune(
    run_dir: str | os.PathLike, keep: int | None, keep_best: int | None = None, maximize: bool = False
) -> list[Path]:
    """Delete the complete checkpoints that are neither among the `keep` newest nor the
    `keep_best` best by their recorded metric (the newest is always kept); returns them."""
    found = all_checkpoints(run_dir)
    if not found:
        return []
    names = kept_names([_stem(p) for _, p in found], keep, keep_best, _metrics(run_dir), maximize)
    if names is None:
        return []
    kept = {path for _, path in found if _stem(path) in names}
    gone = [path for _, path in found if path not in kept]
    for path in gone:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    return gone


def kept_names(
    newest_first: list[str], keep: int | None, keep_best: int | None, scores: dict[str, float], maximize: bool
) -> set[str] | None:
    """The checkpoints (names without .pt, newest first) that --keep-last/--keep-best keep; None:
    no rule asks to delete any. The one rule for the local folder and the bucket (checkpoint/bucket.py)."""
    kept = set(newest_first[: keep if keep else 1])
    if keep_best:
        scored = [n for n in newest_first if n in scores]
        scored.sort(key=lambda n: scores[n], reverse=maximize)
        kept |= set(scored[:keep_best])
    elif not keep:
        return None
    return kept


def metrics_of(run_dir: str | os.PathLike) -> dict[str, float]:
    return _metrics(run_dir)


def _stem(path: Path) -> str:
    return path.name.removesuffix(".pt")
