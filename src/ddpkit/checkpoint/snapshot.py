"""A checkpoint in this node's memory, outside the worker processes.

Every DDP replica holds the whole state, so when a node is lost the survivors already have it:
one process per node (local rank 0) writes it to /dev/shm every few steps, in a thread, and
torch's agent, which restarts every worker after a failure, leaves that folder alone. The
restarted workers resume from it when it is newer than the last disk checkpoint (the
checkpointer decides, checkpointer.py). Disk checkpoints stay for the loss of the whole job.

Under FSDP/HSDP no rank holds the whole state: every rank writes its own shards
(`snapshot-STEP-shard-I-of-N.pt`, I its shard index) into its node's folder, and a restart
can resume from memory only when every shard of one step is still held by some node (HSDP:
a surviving replica group; plain FSDP: no node was lost, only workers).

Private: /dev/shm is shared by every local user, and a snapshot is the model and optimizer (and
what a restart trains from). ddpkit's launcher creates its workers' folder itself, 0700 under an
unpredictable name (`ddpkit-snapshots-RUN-PID-RANDOM`, handed to them in SNAPSHOT_DIR_VAR); under
another agent (torchrun) the folder is named after the rendezvous run id and the agent's process
id, and one that exists already is used only if it is this user's own and private (a folder
another user planted there is refused: the node goes on without snapshots). Files are 0600 and
load as plain data (weights_only=True) once every record matches its CRC-32. Several "nodes"
sharing one /dev/shm (namespaces on one machine) and several jobs never read each other's
snapshots, while the restarted workers of the same agent find theirs.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

from ..errors import DdpkitError
from ..util.envvars import SNAPSHOT_DIR_VAR
from ..util.textfile import write_text_atomic
from .file import BackgroundWriter, atomic_save, load_file

SHM = Path("/dev/shm")
KEEP = 2  # the one being written never replaces the last complete one
_NAME = re.compile(r"^snapshot-(\d+)\.pt$")
_SHARD = re.compile(r"^snapshot-(\d+)-shard-(\d+)-of-(\d+)\.pt$")
_PREFIX = "ddpkit-snapshots-"
_FOLDER = re.compile(rf"^{_PREFIX}(?P<run>[A-Za-z0-9_.]+)-(?P<pid>\d+)(?:-[A-Za-z0-9_]+)?$")


class SnapshotStore:
    """This node's newest states, `KEEP` at most, each written atomically (a temporary file, then
    a rename), one write at a time in a background thread; `mark` records the last step done.
    `shard` (index, count): this rank writes its shards only, and keeps its own `KEEP` newest."""

    def __init__(self, folder: Path, shard: tuple[int, int] | None = None) -> None:
        self.folder, self.shard = private_folder(folder), shard
        self._writer = BackgroundWriter("ddpkit-snapshot", daemon=True)

    @classmethod
    def for_this_node(
        cls, run_id: str, root: Path | None = None, shard: tuple[int, int] | None = None
    ) -> SnapshotStore:
        """The folder of this agent's workers (their parent process) in this job: the one ddpkit's
        launcher made for them, else one named after the job and the agent; a DdpkitError when
        that is not this user's own private folder."""
        given = os.environ.get(SNAPSHOT_DIR_VAR)
        folder = Path(given) if given and root is None else (root or SHM) / f"{_PREFIX}{_safe(run_id)}-{os.getppid()}"
        return cls(folder, shard)

    def path(self, step: int, shard: tuple[int, int] | None = None) -> Path:
        if shard is None:
            return self.folder / f"snapshot-{step:010d}.pt"
        return self.folder / f"snapshot-{step:010d}-shard-{shard[0]}-of-{shard[1]}.pt"

    # -- writing ----------------------------------------------------------------------
    def write(self, step: int, state: dict[str, Any]) -> None:
        """Hand over a state (already a copy the training does not change) for step `step`;
        waits for the previous write first, so that at most one is in flight."""
        self.wait()
        self._writer.submit(lambda: self._write(step, state))

    def _write(self, step: int, state: dict[str, Any]) -> None:
        atomic_save(state, self.path(step, self.shard), private=True)
        if self.shard is None:
            old = self.steps()[:-KEEP]
        else:
            old = sorted(st for st, i, n in self.shards() if (i, n) == self.shard)[:-KEEP]
        for step_ in old:
            self.path(step_, self.shard).unlink(missing_ok=True)

    def wait(self) -> None:
        """Until the write in flight is done; its error, if any, is raised here."""
        self._writer.wait()

    def mark(self, step: int) -> None:
        """The last optimizer step this node finished, and when (what a restart redoes and how
        long it took to train again are measured from it)."""
        write_text_atomic(self.folder / "progress", f"{step} {time.time()!r}\n")

    # -- reading ----------------------------------------------------------------------
    def steps(self) -> list[int]:
        """The steps of the complete snapshots held, oldest first."""
        try:
            names = os.listdir(self.folder)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for m in map(_NAME.match, names) if m)

    def newest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def shards(self) -> list[tuple[int, int, int]]:
        """(step, shard index, shard count) of every complete shard file this node holds."""
        try:
            names = os.listdir(self.folder)
        except FileNotFoundError:
            return []
        return sorted((int(m[1]), int(m[2]), int(m[3])) for m in map(_SHARD.match, names) if m)

    def read(self, step: int, shard: tuple[int, int] | None = None) -> dict[str, Any]:
        """A snapshot as plain data, once every record matches its CRC-32 (file.load_file)."""
        return load_file(self.path(step, shard))

    def progress(self) -> tuple[int, float] | None:
        try:
            step, when = (self.folder / "progress").read_text().split()
        except (FileNotFoundError, ValueError):
            return None
        return int(step), float(when)

    # -- the end ----------------------------------------------------------------------
    def remove(self) -> None:
        """At the run's normal end: this node's folder, and those of this job's agents that are
        gone (nodes lost earlier, when they shared this memory)."""
        self.wait()
        shutil.rmtree(self.folder, ignore_errors=True)
        match = _FOLDER.match(self.folder.name)
        if match is None:
            return
        job = f"{_PREFIX}{match['run']}-"
        for other in self.folder.parent.glob(job + "*"):
            found = _FOLDER.match(other.name)
            if found and found["run"] == match["run"] and not _alive(int(found["pid"])) and _own(other):
                shutil.rmtree(other, ignore_errors=True)


def new_agent_folder(run_id: str, root: Path = SHM) -> Path | None:
    """The launcher, before its agent starts workers: their private snapshot folder (0700, an
    unpredictable name); None where /dev/shm cannot hold one (the workers then go without)."""
    try:
        return Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{_safe(run_id)}-{os.getpid()}-", dir=root))
    except OSError:
        return None


def private_folder(folder: Path) -> Path:
    """`folder`, created 0700 if absent; one that exists must be this user's own directory (not
    a link) that no one else may enter, else a DdpkitError: another local user may have planted
    it to be read (or to read what is written there)."""
    try:
        folder.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    except OSError as e:
        raise DdpkitError(f"cannot create the snapshot folder {folder}: {e.strerror}") from None
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a directory"
        raise DdpkitError(
            f"the snapshot folder {folder} is not this job's own ({kind}, owner uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):04o}; this job runs as uid {os.geteuid()} and needs 0700): another local user "
            "may have planted it; it is not read, and this node keeps no snapshots in memory"
        )
    return folder


def _own(folder: Path) -> bool:
    try:
        st = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", text)[:64]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
