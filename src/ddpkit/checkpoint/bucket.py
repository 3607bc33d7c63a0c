"""The workers' side of a run stored in a bucket: each checkpoint, once complete in the local
staging folder, committed to the bucket (storage/remote.py: every object, the manifest last),
then the bucket's old checkpoints pruned by the same rule as the local folder's.

Rank 0 uploads (the staging folder is one node's: every rank's shards are in it once the
sharded save returned), inline or, with --async-save, in the background writer, so the step
does not wait for the network. The launcher (run/staging.py) said where the bucket is.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from ..config.faults import Faults
from ..storage.location import Remote, parse
from ..storage.remote import RemoteRun
from ..util.envvars import RUN_URL_VAR
from .file import CKPT_DIR
from .retention import METRICS, kept_names, metrics_of

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
    """Rank 0: commit `checkpoint` (complete in the staging folder) to the bucket, with the run's
    side files; then delete from the bucket what --keep-last/--keep-best no longer keep."""
    remote = current()
    if remote is None:
        return
    remote.commit(checkpoint, [(run_dir / rel, rel) for rel in SIDE_FILES])
    names = remote.committed()
    stems = [n.removesuffix(".pt") for n in names]
    maximize = faults.best_metric.endswith(":max")
    keep = kept_names(stems, faults.keep_last, faults.keep_best, metrics_of(run_dir), maximize)
    if keep is not None:
        for name, stem in zip(names, stems, strict=True):
            if stem not in keep:
                remote.delete(name)
