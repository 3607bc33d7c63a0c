"""The workers' side of a run stored in a bucket: each checkpoint, once complete in the local
staging folder, committed to the bucket (storage/remote.py: every object, the manifest last),
then the bucket's old checkpoints pruned by the same rule as the local folder's.

A sharded checkpoint: every rank uploads the shards it wrote and then a report of them; rank 0
uploads its own, waits for every report and writes the manifest. A one-file checkpoint: rank 0.
Inline, or with --async-save in each rank's background writer, so the step does not wait for
the network. The launcher (run/staging.py) said where the bucket is.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
from pathlib import Path
from typing import Any

from ..config.faults import Faults
from ..storage.location import Remote, parse
from ..storage.remote import RemoteRun
from ..util.envvars import RUN_URL_VAR
from .file import CKPT_DIR
from .retention import METRICS, kept_names, metrics_of

_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")
_NAME = re.compile(r"^epoch-\d+(-step-\d+)?(\.pt)?$")  # a checkpoint, a file or a folder of shards
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


def shards_folder(final: Path) -> Path:
    """Where this rank's files of the sharded checkpoint `final` are, once it is written: `final`
    on rank 0's node; on another node of a run staged per node, the partial folder rank 0 never
    renamed there (sharded.write_shards), whose name is not a checkpoint's for any reader. A
    same-named folder on such a node is an older save's: it goes (the bucket's is the one)."""
    partial = final.parent / f".{final.name}.partial"
    if not partial.is_dir():
        return final
    shutil.rmtree(final, ignore_errors=True)
    return partial


def publish_shards(run_dir: Path, folder: Path, faults: Faults, rank: int, world_size: int) -> None:
    """Every rank: its own files of the sharded checkpoint `folder`, straight to the bucket.
    Rank 0 then waits for every rank's report and writes the manifest last (the commit), then
    prunes the bucket as --keep-last/--keep-best say: a checkpoint is deleted only after a newer one exists.
    Files in a partial folder (another node's, shards_folder) are deleted once uploaded: a resume
    there fetches the committed checkpoint."""
    remote = current()
    if remote is None:
        return
    own = sorted(p for p in folder.iterdir() if p.is_file() and owner(p.name) == rank)
    if rank != 0:
        remote.upload_shards(folder.with_name(folder.name.removeprefix(".").removesuffix(".partial")), own, rank)
        if folder.name.endswith(".partial"):
            for path in own:
                path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                folder.rmdir()  # the node's last rank to finish removes it
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


def several_nodes(rt: Any) -> bool:
    """A run stored in a bucket on several nodes: each node stages it in a folder of its own,
    so a checkpoint is read from the bucket, the one place every node sees."""
    return current() is not None and rt.env.nnodes > 1


def sync_for_resume(run_dir: Path, rt: Any) -> None:
    """Rank 0 of a run on several nodes, before it picks the checkpoint to resume from: its
    node's folder holds the newest committed checkpoint, whole, and no other. What it wrote
    itself lacks the other nodes' shards, one whose commit never came could be fetched by no
    other node, and the newest is fetched if rank 0 now runs on another node than the one that
    wrote it (a damaged one is skipped in one line, the next newest fetched)."""
    remote = current()
    if remote is None or not rt.is_main:
        return
    committed = remote.committed()
    newest = run_dir / CKPT_DIR / committed[0] if committed else None
    whole = newest is not None and _whole_here(remote, newest)
    folder = run_dir / CKPT_DIR
    for path in [p for p in folder.iterdir() if _NAME.match(p.name)] if folder.is_dir() else []:
        if not (whole and path == newest):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    if committed and not whole:
        remote.fetch_newest(folder, lambda line: print(line, flush=True))


def _whole_here(remote: RemoteRun, local: Path) -> bool:
    """Does `local` hold every object of the committed checkpoint of its name? (their sums are
    checked when it is read, as any checkpoint's)."""
    if not local.is_dir():
        return local.is_file()
    listed = set(remote.manifest(local.name)["objects"])
    return listed == {p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()}


def fetch_chosen(path: Path, rt: Any) -> None:
    """Collective, on several nodes: the sharded checkpoint rank 0 chose (`path`, committed) is
    whole on every node, fetched from the bucket by a node's local rank 0 where it is not."""
    remote = current()
    if remote is not None and rt.env.local_rank == 0 and not rt.is_main and not _whole_here(remote, path):
        remote.fetch(path.name, path.parent)
    rt.barrier()
