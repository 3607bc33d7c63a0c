"""Which collectives this rank issued: op, shape, dtype, path, sequence number, caller.

When a job hangs, the question is "which ranks wait in which collective, and which rank
never arrived". torch's flight recorder answers it for the process group's own collectives
(gloo and NCCL, TORCH_FR_BUFFER_SIZE); the collectives that ddpkit runs in shared memory
(runtime/shm.py: gradient buckets, loss sums, flags) never reach the process group, so
ddpkit keeps its own record of every all-reduce it issues, through either path. A hang
report (runtime/watchdog.py) writes it next to the rank's stacks.

The record is one per process, like torch's flight recorder and faulthandler (it follows the
process, not one process group): a ring of the last ENTRIES collectives, each numbered by
`seq`, this rank's count of collectives so far. Every rank of a job issues the same
collectives in the same order, so equal `seq` means "the same collective" on every rank;
a rank at a different op or shape for the same `seq` has skipped or added one. Cost: one
walk up the Python stack per collective (~2-4 us), next to gloo's ~300 us.
"""
from __future__ import annotations

import os
import sys
import sysconfig
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Iterator

ENTRIES = 64
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../ddpkit
_RUNTIME = os.path.join(_PKG, "runtime")
_TASKS = os.path.join(_PKG, "tasks")
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_SCRIPTS = os.path.join(sys.prefix, "bin") + os.sep  # console scripts (bin/ddpkit)


@dataclass
class Entry:
    seq: int
    op: str
    shape: list[int]
    dtype: str
    path: str  # "backend" (the process group) or "shm"
    what: str  # "" or what it carries ("gradient bucket")
    caller: str  # FILE:LINE in FUNCTION of the first frame outside ddpkit's runtime and torch
    user: str  # the same for the first frame outside ddpkit and torch ("" when none: ddpkit's own loop)
    started: float  # time.time()
    state: str = "waiting"  # "waiting", "done", or "failed: ..."
    seconds: float | None = None

    def describe(self) -> str:
        what = f", {self.what}" if self.what else ""
        return f"{self.op} #{self.seq} (shape {self.shape}, {self.dtype}, {self.path}{what})"


def short(filename: str) -> str:
    """A path as a user reads it: relative to ddpkit's package, or the file's last 2 parts."""
    if filename.startswith(_PKG + os.sep):
        return "ddpkit/" + filename[len(_PKG) + 1:]
    parts = filename.split(os.sep)
    return os.sep.join(parts[-2:]) if len(parts) > 2 else filename


def is_library(filename: str) -> bool:
    """Frames of ddpkit (not its built-in tasks), torch, the standard library."""
    if filename.startswith(_PKG + os.sep):
        return not filename.startswith(_TASKS + os.sep)
    return f"{os.sep}torch{os.sep}" in filename or filename.startswith((_STDLIB, _SCRIPTS, "<"))


def where(frame: Any) -> str:
    return f"{short(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def callers(frame: Any) -> tuple[str, str]:
    """(first frame outside ddpkit's runtime and torch, first frame outside any library)."""
    caller = user = ""
    while frame is not None:
        name = frame.f_code.co_filename
        if not caller and not name.startswith(_RUNTIME) and f"{os.sep}torch{os.sep}" not in name:
            caller = where(frame)
        if not is_library(name):
            user = where(frame)
            break
        frame = frame.f_back
    return caller, user or ""


class CollectiveRecord:
    """The last ENTRIES collectives of this process, in the order it issued them."""

    def __init__(self, entries: int = ENTRIES) -> None:
        self.entries: deque[Entry] = deque(maxlen=entries)
        self.seq = 0
        self.last_done = 0.0  # time.time() of the last completed collective (0: none yet)
        self._lock = threading.Lock()  # the watchdog thread reads while the main thread appends

    def finish(self, entry: Entry, error: BaseException | None = None) -> None:
        now = time.time()
        entry.seconds = now - entry.started
        if error is None:
            entry.state = "done"
            self.last_done = now
        else:
            entry.state = f"failed: {str(error).splitlines()[0][:200] if str(error) else type(error).__name__}"

    def track(self, op: str, tensor: Any, path: str, what: str = "") -> _Tracked:
        """`with record.track("all_reduce", t, "shm"): ...` records the collective around the block."""
        return _Tracked(self, op, tensor, path, what)

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return [asdict(e) for e in self.entries]

    def pending(self) -> Entry | None:
        """The collective this rank is inside now (or the last that failed), if any."""
        with self._lock:
            last = self.entries[-1] if self.entries else None
        return last if last is not None and last.state != "done" else None

    def __iter__(self) -> Iterator[Entry]:
        with self._lock:
            return iter(list(self.entries))


class _Tracked:
    __slots__ = ("record", "args", "entry")

    def __init__(self, record: CollectiveRecord, *args: Any) -> None:
        self.record, self.args = record, args

    def __enter__(self) -> Entry:
        op, tensor, path, what = self.args
        caller, user = callers(sys._getframe(1))
        rec = self.record
        with rec._lock:
            rec.seq += 1
            self.entry = Entry(rec.seq, op, list(tensor.shape), str(tensor.dtype).replace("torch.", ""), path, what,
                               caller, user, time.time())
            rec.entries.append(self.entry)
        return self.entry

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        self.record.finish(self.entry, error)


RECORD = CollectiveRecord()  # this process's record (see the module docstring: one per process)
