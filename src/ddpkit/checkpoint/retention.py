"""--keep-last K: only the K newest complete checkpoints stay. Older ones are deleted only
after a newer one is complete (renamed into place), so a crash mid-save never leaves fewer
than K; a crash between the rename and the deletion leaves K+1, pruned at the next save or
resume. Temporaries of an interrupted save (.tmp files, .partial folders) are never counted."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from .file import list_checkpoints


def all_checkpoints(run_dir: str | os.PathLike) -> list[tuple[tuple[int, int], Path]]:
    """((epoch, step), path) of every complete checkpoint of either kind, newest first."""
    from .sharded import list_sharded  # torch.distributed.checkpoint: ~0.5 s to import, only when needed

    return sorted(list_checkpoints(run_dir) + list_sharded(run_dir), reverse=True)


def prune(run_dir: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the `keep` newest complete checkpoints; returns what was deleted."""
    gone = [path for _, path in all_checkpoints(run_dir)[keep:]]
    for path in gone:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    return gone
