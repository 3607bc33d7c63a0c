"""A run folder in a bucket as a local folder, for the commands that read a run (export, plot):
downloaded into a temporary folder that is gone when the command ends; and a command's output
(`--out`) at a URL: written locally, then uploaded.

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
from .errors import explained
from .location import Remote, filesystem, parse
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


@contextlib.contextmanager
def local_output(text: str | None, must_be_empty: bool = False) -> Iterator[str | None]:
    """Where a command writes its output (`--out`): `text` itself when it is local (or None); for
    a bucket URL, a temporary local path of the same name, uploaded there (a folder object by
    object) once the command succeeded, and gone afterwards. `must_be_empty`: a URL that
    already holds objects is refused, as a local folder that is not empty is."""
    if text is None or not isinstance(where := parse(text), Remote):
        yield text
        return
    fs = filesystem(where)
    if must_be_empty:
        with explained(where, "checking the output's place"):
            if fs.find(where.path):
                raise DdpkitError(f"{where.url}: already holds objects; give a prefix that holds none")
    tmp = Path(tempfile.mkdtemp(prefix="ddpkit-out-"))
    local = tmp / where.path.rsplit("/", 1)[-1]
    try:
        yield str(local)
        files = sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else [local]
        with explained(where, f"uploading to {where.url}"):
            for path in files:
                rel = path.relative_to(local).as_posix() if local.is_dir() else ""
                fs.put_file(str(path), where.join(rel) if rel else where.path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def shown_as(local: str | None, url: str | None) -> Callable[[str], str]:
    """A line that names the temporary `local` path, with the URL the user gave in its place."""
    if local is None or url is None or local == url:
        return lambda line: line
    return lambda line: line.replace(local, url)
