"""A run stored in a bucket, in the launcher: checked before any worker starts, staged in a
local folder the workers write as they would any run directory, and copied back.

Before the start: the bucket answers, exists and takes a write (one line otherwise, before a
worker trains a step); a run already there is refused without --resume as a local one is;
with --resume/--auto-resume the newest committed checkpoint that downloads intact is fetched
into the staging folder (a damaged one skipped in one line) with the run's other files. The
workers then commit each checkpoint to the bucket themselves (checkpoint/bucket.py); at the
end the rest of the folder (model.pt, summary.json, metrics.jsonl, ...) is uploaded.

On several nodes every node's launcher does all of this with a staging folder of its own: each
rank uploads the shards it wrote from its node's folder, and only the node where rank 0 ran
(the folder's world mark is this launch's) uploads the rest at the end; the other nodes' copies
of the run's files are the stale ones fetched at the start. Logs (--log-dir) and hang reports
stay on the node that wrote them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from ..checkpoint.world_mark import started_by_this_launch
from ..config import RunConfig
from ..errors import DdpkitError
from ..storage.errors import StoreError, explained
from ..storage.location import Remote, parse
from ..storage.remote import CKPT, RemoteRun
from ..util.envvars import RUN_URL_VAR

_NOT_UPLOADED = (".", "hang/")  # this launch's own marks and hang reports stay local


@contextlib.contextmanager
def staged(cfg: RunConfig) -> Iterator[RunConfig]:
    """`cfg` as it is for a local run folder; for a URL, `cfg` whose run directory is a fresh
    local staging folder, copied to the bucket on the way out (a failed run's record too)."""
    where = parse(cfg.run_dir) if cfg.run_dir else None
    if not isinstance(where, Remote):
        yield cfg
        return
    remote = RemoteRun(where)
    remote.preflight()
    stage = Path(tempfile.mkdtemp(prefix="ddpkit-stage-"))
    try:
        fetch_for_start(cfg, remote, stage)
        os.environ[RUN_URL_VAR] = remote.url
        ok = False
        try:
            yield cfg.replace(run_dir=str(stage))
            ok = True
        finally:
            os.environ.pop(RUN_URL_VAR, None)
            if not cfg.multi_node or started_by_this_launch(stage):  # rank 0's node: the others hold no run file
                _upload_rest(remote, stage, ok)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


@contextlib.contextmanager
def init_from_fetched(cfg: RunConfig) -> Iterator[RunConfig]:
    """`cfg` as it is, or with --init-from URL downloaded into a temporary folder (a file, or an
    HF folder) for the workers to read as a local path (weights-only, as any --init-from)."""
    where = parse(cfg.init_from) if cfg.init_from else None
    if not isinstance(where, Remote):
        yield cfg
        return
    fs = RemoteRun(where).fs
    tmp = Path(tempfile.mkdtemp(prefix="ddpkit-init-"))
    try:
        dest = tmp / where.path.rsplit("/", 1)[-1]
        with explained(where, "downloading --init-from"):
            if not fs.exists(where.path):
                raise StoreError(f"--init-from {where.url}: no such object or folder")
            fs.get(where.path, str(dest), recursive=fs.isdir(where.path))
        yield cfg.replace(init_from=str(dest))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fetch_for_start(cfg: RunConfig, remote: RemoteRun, stage: Path) -> None:
    """What the start needs of the bucket, in `stage`: nothing for a fresh run (one already there
    is refused without --resume), the newest intact committed checkpoint and the run's files to continue."""
    holds = remote.holds_run()
    if not (cfg.resume or cfg.auto_resume):
        if holds:
            raise DdpkitError(
                f"{remote.url} already holds a run: pass --resume to continue it, or choose another --run-dir"
            )
        remote.remove_orphans()
        return
    remote.remove_orphans()  # what a killed upload left: no manifest, never read
    if not remote.committed():
        if cfg.resume:
            raise DdpkitError(
                f"--resume: no committed checkpoint in {remote.url}/{CKPT}; run without --resume to start fresh"
            )
        return
    remote.get_run_files(stage)
    if remote.fetch_newest(stage / CKPT, lambda line: print(line, flush=True)) is None and cfg.resume:
        raise DdpkitError(f"--resume: no intact committed checkpoint in {remote.url}/{CKPT} (each one skipped above)")


def _upload_rest(remote: RemoteRun, stage: Path, ok: bool) -> None:
    """The run's files but checkpoints (committed as they were written); after a failure what
    can be sent is sent and a failure of that is one more line, not the error the user sees."""
    skip = lambda rel: rel.startswith(_NOT_UPLOADED) or "/." in rel  # noqa: E731
    try:
        remote.put_run_files(stage, skip)
    except StoreError as e:
        if ok:
            raise DdpkitError(f"{e} (the run itself finished: its checkpoints are committed)") from None
        print(f"ddpkit: {e}", flush=True)
