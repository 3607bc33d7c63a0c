"""One job description for every engine: a config file's `[launch]` table with the command's
own flags over it (a flag given wins, as flags win over a config file's training settings),
and the checks every engine makes before it submits anything: the run directory of a job on
several nodes must be on storage they all share, and the job has one run directory."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, Callable

from ..config.file import read_launch_table
from ..config.launch import KEYS, LaunchTable
from ..errors import DdpkitError
from ..storage.location import is_url

# File systems that one machine's disk is: a run directory on them is not seen by another node
LOCAL_FILE_SYSTEMS = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs", "ramfs", "vfat", "devtmpfs"}
)


def job_description(config: str | None, **flags: Any) -> LaunchTable:
    """The job: the [launch] table of `config` (when given) under `flags` (keys of LaunchTable;
    None: not given on the command line, so the file's value stands)."""
    unknown = sorted(set(flags) - set(KEYS))
    if unknown:
        raise TypeError(f"job_description: no [launch] key {', '.join(unknown)}")
    table = read_launch_table(config) if config else LaunchTable()
    given = {k: v for k, v in flags.items() if v is not None}
    return dataclasses.replace(table, **given) if given else table


def file_system_of(path: str | Path, mounts: str = "/proc/mounts") -> str | None:
    """The type of the file system `path` is (or would be) on: the longest mount point above
    it in `mounts`; None where that cannot be read (not Linux)."""
    p = Path(path).resolve()  # a run directory not made yet: by its path, under the mounts above it
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return None
    best, kind = "", None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = str(p) == point or str(p).startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, parts[2]
    return kind


def check_run_dir_shared(
    run_dir: str | Path,
    job: LaunchTable,
    engine: str,
    dry_run: bool = False,
    warn: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
    mounts: str = "/proc/mounts",
) -> None:
    """A job on several nodes writes one run directory from all of them (rank 0 the model, every
    rank its shards, a restarted node reads them back): on a local disk each node would see its
    own half. Refused in one line, unless the job says the directory is shared (one machine, or a
    file system ddpkit does not recognise); a dry run only warns."""
    if (job.nodes or 1) < 2 or job.shared_run_dir:
        return
    kind = file_system_of(run_dir, mounts)
    if kind is None or kind not in LOCAL_FILE_SYSTEMS:
        return
    message = (
        f"the run directory {run_dir} is on {kind}, a disk of this machine, but the {engine} job spans "
        f"{job.nodes} nodes: each would write and resume from its own copy. Put it on shared storage "
        "(NFS, Lustre, a shared volume), or pass --shared-run-dir (shared_run_dir = true in [launch]) "
        "if every node does see it"
    )
    if dry_run:
        warn(f"ddpkit: warning: {message}")
        return
    raise DdpkitError(message)


def run_dir_of(job: LaunchTable, train_run_dir: str | None, local: bool = True) -> str | None:
    """The job's one run directory: [launch] run_dir or the training's --run-dir / run_dir;
    two different ones are refused (which would the job write?). `local`: a path of this
    machine, made absolute; else a path where the job runs (a pod's volume), taken as written."""
    if job.run_dir and train_run_dir and not _same_path(job.run_dir, train_run_dir, local):
        raise DdpkitError(
            f"two run directories: {job.run_dir} ([launch] run_dir or the command's --run-dir) and "
            f"{train_run_dir} (the training's run_dir): keep one"
        )
    chosen = job.run_dir or train_run_dir
    if is_url(chosen):  # Path() would make s3://b/x a folder 's3:' in the job
        raise DdpkitError(
            f"--run-dir {chosen}: a SLURM or Ray job does not take a bucket run folder (srun or Ray starts its "
            "workers, and a run in a bucket is staged by a `ddpkit train` that starts its node's workers itself); "
            "give a shared folder, or run it with `ddpkit k8s` or `ddpkit sky`, which do"
        )
    return os.fspath(Path(chosen).resolve()) if chosen and local else chosen


def _same_path(a: str, b: str, local: bool) -> bool:
    return Path(a).resolve() == Path(b).resolve() if local else a.rstrip("/") == b.rstrip("/")
