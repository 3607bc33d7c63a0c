"""The workers' side of a run stored in a bucket: each checkpoint, once complete in the local
staging folder, committed to the bucket (storage/remote.py: every object, the manifest last),
then the bucket's old checkpoints pruned by the same rule as the local folder's.

A sharded checkpoint: every rank uploads the shards it wrote and then a report of them; rank 0
uploads its own, waits for every report and writes the manifest. A one-file checkpoint: rank 0.
Inline, or with --async-save in each rank's background writer, so the step does not wait for
the network. The launcher (run/staging.py) said where the bucket is.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

from ..config.faults import Faults
from ..storage.location import Remote, parse
from ..storage.remote import RemoteRun
from ..util.envvars import RUN_URL_VAR
from .file import CKPT_DIR
from .retention import METRICS, kept_names, metrics_of

_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")
REPORT_TIMEOUT_S = 600.0  # rank 0 waits this long for the other ranks' uploads (a dead rank ends the job sooner)
SIDE_FILES = ("config.json", "metrics.jsonl", f"{CKPT_DIR}/{METRICS}")  # uploaded with each checkpoint


@functools.lru_cache(maxsize=4)
def _remote_run(url: str) -> RemoteRun:
    where = parse(url)
    assert isinstance(where, Remote)
    return RemoteRun(where)


def current() -> RemoteRun | None:
    """The bucket this run is stored in (the launcher's variable), or None for a local run."""
    url = os.environ.get(RUN_URL_VAR)
    return _remote_run(url) if url else None


def shown(path: str | os.PathLike, run_dir: Path) -> str:
    """`path` inside the staging folder as the user knows it: under the bucket's URL."""
    remote = current()
    text = str(path)
    if remote is None or not text.startswith(str(run_dir)):
        return text
    return remote.url + text[len(str(run_dir)) :]


def publish(run_dir: Path, checkpoint: Path, faults: Faults) -> None:
    """Rank 0: commit the one-file `checkpoint` (complete in the staging folder) to the bucket,
    with the run's side files; then delete from the bucket what --keep-last/--keep-best no longer keep."""
    remote = current()
    if remote is None:
        return
    remote.commit(checkpoint, [(run_dir / rel, rel) for rel in SIDE_FILES])
    _prune(remote, run_dir, faults)


def owner(file_name: str) -> int:
    """The rank that wrote a file of a sharded checkpoint: DCP's `__RANK_N.distcp`; the rest
    (.metadata, ddpkit.pt) is rank 0's."""
    m = _SHARD.match(file_name)
    return int(m.group(1)) if m else 0


def publish_shards(run_dir: Path, folder: Path, faults: Faults, rank: int, world_size: int) -> None:
    """Every rank: its own files of the sharded checkpoint `folder`, straight to the bucket.
    Rank 0 then waits for every rank's report and writes the manifest last (the commit), then
    prunes the bucket as --keep-last/--keep-best say: a checkpoint is deleted only after a newer one exists."""
    remote = current()
    if remote is None:
        return
    own = sorted(p for p in folder.iterdir() if p.is_file() and owner(p.name) == rank)
    if rank != 0:
        remote.upload_shards(folder, own, rank)
        return
    remote.commit_shards(folder, own, world_size, REPORT_TIMEOUT_S)
    remote.put_files([(run_dir / rel, rel) for rel in SIDE_FILES])
    _prune(remote, run_dir, faults)


def uncommit(name: str) -> None:
    """Rank 0, before a sharded checkpoint `name` is written: if the bucket has one of that name,
    it stops existing before any rank overwrites its objects."""
    remote = current()
    if remote is not None:
        remote.uncommit(name)


def _prune(remote: RemoteRun, run_dir: Path, faults: Faults) -> None:
    names = remote.committed()
    stems = [n.removesuffix(".pt") for n in names]
    maximize = faults.best_metric.endswith(":max")
    keep = kept_names(stems, faults.keep_last, faults.keep_best, metrics_of(run_dir), maximize)
    if keep is not None:
        for name, stem in zip(names, stems, strict=True):
            if stem not in keep:
                remote.delete(name)
