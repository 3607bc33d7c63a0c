"""Which collectives this rank issued: op, shape, dtype, path, sequence number, caller.

When a job hangs, the question is "which ranks wait in which collective, and which rank
never arrived". torch's flight recorder answers it for the process group's own collectives
(gloo and NCCL, TORCH_FR_BUFFER_SIZE); the collectives that ddpkit runs in shared memory
(runtime/shm.py: gradient buckets, loss sums, flags) never reach the process group, so
ddpkit keeps its own record of every all-reduce it issues, through either path. A hang
report (runtime/watchdog.py) writes it next to the rank's stacks.

The record belongs to the Runtime (its Collectives write to it, so does the shared-memory
mapping they hand gradient buckets to, and ddpkit.all_sum reaches it through the active
Runtime); the watchdog is given it. It is a ring of the last ENTRIES collectives, each numbered
by `seq`, this rank's count of collectives so far. Every rank of a job issues the same
collectives in the same order, so equal `seq` means "the same collective" on every rank;
a rank at a different op or shape for the same `seq` has skipped or added one. Cost: ~1 us
per collective (the calling frame, one or two frames up; the user's line of the collective a
rank is stuck in is read from its live stack when a report is written), next to gloo's ~300 us
and the shared-memory path's ~1 us.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import time
from collections import deque
from dataclasses import dataclass, fields
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
    shape: Any  # torch.Size (a list in as_dict)
    dtype: Any  # torch.dtype (a name in as_dict)
    path: str  # "backend" (the process group) or "shm"
    what: str  # "" or what it carries ("gradient bucket")
    caller: Any  # (file, line, function) of the first frame outside ddpkit's runtime and torch
    started: float  # time.time()
    user: Any = None  # the innermost user frame (outside any library) of the main thread's stack, filled
    # in by a hang report for the collective a rank is inside (found at record time it would cost a stack walk)
    state: str = "waiting"  # "waiting", "done", or "failed: ..."
    seconds: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain data, sites as FILE:LINE in FUNCTION (formatted only when a report is written)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(
            shape=list(self.shape),
            dtype=str(self.dtype).replace("torch.", ""),
            caller=where(self.caller),
            user=where(self.user) if isinstance(self.user, tuple) else (self.user or ""),
        )
        return d

    def describe(self) -> str:
        what = f", {self.what}" if self.what else ""
        return (
            f"{self.op} #{self.seq} (shape {list(self.shape)}, "
            f"{str(self.dtype).replace('torch.', '')}, {self.path}{what})"
        )


def short(filename: str) -> str:
    """A path as a user reads it: relative to ddpkit's package, or the file's last 2 parts."""
    if filename.startswith(_PKG + os.sep):
        return "ddpkit/" + filename[len(_PKG) + 1 :]
    parts = filename.split(os.sep)
    return os.sep.join(parts[-2:]) if len(parts) > 2 else filename


def is_library(filename: str) -> bool:
    """Frames of ddpkit (not its built-in tasks), torch, the standard library."""
    if filename.startswith(_PKG + os.sep):
        return not filename.startswith(_TASKS + os.sep)
    return f"{os.sep}torch{os.sep}" in filename or filename.startswith((_STDLIB, _SCRIPTS, "<"))


def caller_of(frame: Any) -> Any:
    """(file, line, function) of the first frame outside ddpkit's runtime and torch: the code
    that issued the collective (one or two frames up; ~0.3 us)."""
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        code = frame.f_code
        name = code.co_filename
        if not (name.startswith(_RUNTIME) or _TORCH in name):
            return (name, frame.f_lineno, code.co_name)
        frame = frame.f_back
    return None


_TORCH = f"{os.sep}torch{os.sep}"
_MAX_FRAMES = 20


def where(site: Any) -> str:
    """FILE:LINE in FUNCTION of a (file, line, function) tuple ("" for None)."""
    return f"{short(site[0])}:{site[1]} in {site[2]}" if site else ""


class CollectiveRecord:
    """The last ENTRIES collectives of this process, in the order it issued them."""

    def __init__(self, entries: int = ENTRIES) -> None:
        self.entries: deque[Entry] = deque(maxlen=entries)
        self.seq = 0
        self.last_done = 0.0  # time.time() of the last completed collective (0: none yet)

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
        return [e.as_dict() for e in list(self.entries)]  # list(deque) copies in C, under the GIL: a consistent view

    def pending(self) -> Entry | None:
        """The collective this rank is inside now (or the last that failed), if any."""
        entries = list(self.entries)
        last = entries[-1] if entries else None
        return last if last is not None and last.state != "done" else None

    def __iter__(self) -> Iterator[Entry]:
        return iter(list(self.entries))


class _Tracked:
    __slots__ = ("record", "args", "entry")

    def __init__(self, record: CollectiveRecord, *args: Any) -> None:
        self.record, self.args = record, args

    def __enter__(self) -> Entry:
        op, tensor, path, what = self.args
        rec = self.record
        rec.seq += 1  # only the main thread records; the watchdog thread only reads
        self.entry = Entry(
            rec.seq, op, tensor.shape, tensor.dtype, path, what, caller_of(sys._getframe(1)), time.time()
        )
        rec.entries.append(self.entry)  # deque.append is atomic under the GIL
        return self.entry

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        self.record.finish(self.entry, error)
