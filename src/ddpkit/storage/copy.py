"""A run folder in a bucket as a local folder, for the commands that read a run (export, plot):
downloaded into a temporary folder that is gone when the command ends.

Only what the manifest rule allows is taken: the run's files and, when asked, one committed
checkpoint checked against its manifest (a damaged one skipped in one line); nothing is
unpickled here, the readers load what they load weights-only as from a local folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from ..errors import DdpkitError
from .location import Remote, parse
from .remote import CKPT, RemoteRun


@contextlib.contextmanager
def local_run(
    text: str | os.PathLike,
    checkpoint: str | None | bool = True,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
) -> Iterator[Path]:
    """`text` itself when it is a local folder; a bucket's run downloaded: its files, and the
    committed checkpoint `checkpoint` names (True: the newest intact one; False: none)."""
    where = parse(text)
    if not isinstance(where, Remote):
        yield where
        return
    run = RemoteRun(where)
    tmp = Path(tempfile.mkdtemp(prefix="ddpkit-run-"))
    try:
        got = run.get_run_files(tmp)
        if isinstance(checkpoint, str) and checkpoint in run.committed():
            run.fetch(checkpoint, tmp / CKPT)
        elif checkpoint is True:
            run.fetch_newest(tmp / CKPT, say)
        if not got and not (tmp / CKPT).is_dir():
            raise DdpkitError(f"{where.url}: no run there (no config.json, model.pt or committed checkpoint)")
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
