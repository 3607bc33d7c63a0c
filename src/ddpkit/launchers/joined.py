"""Did the workers of a launch ever join a process group? Some real scripts check for GPUs and
exit 0 after one line on a machine without them (the FSDP2 example, minGPT-ddp); the job then
"succeeds" having trained nothing, under torchrun and ddpkit alike. The launcher says so.

How, without touching the workers: a worker that joins torch's process group (env://)
connects to MASTER_ADDR:MASTER_PORT, and Linux keeps every TCP connection in /proc/net/tcp
for a minute after it closes (TIME_WAIT). So: read MASTER_PORT from a worker's environment
while the workers run, and after they exit look for any connection on that port. Workers gone
before their environment could be read lived too briefly to import torch, let alone join.
Linux only; elsewhere (or when /proc cannot be read) nothing is said."""

from __future__ import annotations

import os
import threading
from pathlib import Path


class JoinWatch:
    """Started before the workers, finished after they all exited: `never_joined()`."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.port: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ddpkit-join-watch", daemon=True)
        self.usable = Path("/proc/self/stat").exists() and Path("/proc/net/tcp").exists()

    def start(self) -> JoinWatch:
        if self.usable:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def never_joined(self) -> bool:
        """True when no worker of this launch connected to its MASTER_PORT (call after stop())."""
        if not self.usable:
            return False
        if self.port is None:
            return True  # every worker had exited before its environment could be read
        return not _port_seen(self.port)

    def _watch(self) -> None:
        while not self._stop.is_set() and self.port is None:
            for pid in _children():
                port = _master_port(pid)
                if port is not None:
                    self.port = port
                    return
            self._stop.wait(self.interval_s)


def _children() -> list[int]:
    """This process's children (the agent starts each worker as one)."""
    me = str(os.getpid())
    pids: list[int] = []
    for task in Path("/proc/self/task").iterdir():
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:  # a kernel without the children file: scan every process's parent
            return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == me]
    return pids


def _parent(proc: Path) -> str | None:
    try:
        return (proc / "stat").read_text().rsplit(")", 1)[1].split()[1]
    except (OSError, IndexError):
        return None


def _master_port(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"MASTER_PORT="):
            value = item.split(b"=", 1)[1]
            return int(value) if value.isdigit() else None
    return None


def _port_seen(port: int) -> bool:
    """Any TCP connection of this network namespace, open or closed within the last minute,
    with `port` at either end."""
    hex_port = f"{port:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 2 and hex_port in (fields[1].rsplit(":", 1)[1], fields[2].rsplit(":", 1)[1]):
                return True
    return False


NEVER_JOINED = (
    "ddpkit: warning: the {n} workers all exited without ever joining a process group (none connected to "
    "MASTER_ADDR:MASTER_PORT); likely the script checked for GPUs (or another requirement) and quit: "
    "see its output above"
)
