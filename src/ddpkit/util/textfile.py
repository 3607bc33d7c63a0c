"""Small text files that readers must see whole or not at all (a requeue request, a node's last
step, a failure record, the metrics of kept checkpoints)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """`text` into `path` through a temporary file of its own in the same folder, renamed over
    `path`: a reader sees the old file or the new one, never a part, and writers that race (two
    processes, two threads) never share a temporary file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_own_text(path: str | os.PathLike) -> str:
    """The text of a file a run wrote in its own folder, never through a symbolic link (a crafted
    folder's summary.json -> a file elsewhere): a link raises OSError, read as a missing file."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, errors="replace") as f:
        return f.read()
