"""What a launch changes in the launcher's own process, for the launch only: the environment
the agent hands its workers, torch's tail of --tee'd log files (whole lines), the signal handlers
torch's agent installs. Each is put back when the launch returns or raises."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any, Callable, Iterator


@contextlib.contextmanager
def scoped_environ(changes: dict[str, str], also: tuple[str, ...] = ()) -> Iterator[None]:
    """os.environ with `changes` for the duration, then exactly these keys (and `also`, which
    others set meanwhile) as they were; what anyone else changed meanwhile stays."""
    before = {k: os.environ.get(k) for k in (*changes, *also)}
    os.environ.update(changes)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def whole_line_tail() -> Iterator[None]:
    """torch's agent tails --tee'd log files with tail_log.tail_logfile, a module global it
    offers no parameter for: ddpkit's whole-line version for the launch, torch's after."""
    from torch.distributed.elastic.multiprocessing import tail_log

    torch_tail = tail_log.tail_logfile
    tail_log.tail_logfile = tail_whole_lines
    try:
        yield
    finally:
        tail_log.tail_logfile = torch_tail


@contextlib.contextmanager
def signal_handlers_kept() -> Iterator[None]:
    """torch's agent installs handlers that raise its SignalException (for SIGTERM, SIGINT, SIGHUP,
    SIGQUIT) and leaves them: the caller's own are back after the launch."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread has handlers to set (the agent then sets none either)
        return
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    kept = {sig: signal.getsignal(sig) for sig in (getattr(signal, n, None) for n in names) if sig is not None}
    try:
        yield
    finally:
        for sig, handler in kept.items():
            if handler is not None:
                signal.signal(sig, handler)


def tail_whole_lines(
    header: str,
    file: str,
    dst: Any,
    finished: Any,
    interval_sec: float,
    log_line_filter: Callable[[str], bool] | None = None,
) -> None:
    """torch's tail of a worker's log file for --tee, but it writes whole lines only: torch's
    writes what readline() returns at the end of the file, so a line the worker is writing
    at that moment comes out in two pieces, each with its rank prefix (seen in 1 of 3 CI runs:
    '[rank0]:rank 0 to stderr[rank0]:'). A piece waits here for the rest of its line. A line
    that already starts with its rank's prefix keeps that one (see _prefixed)."""
    while not os.path.exists(file):
        if finished.is_set():
            return
        time.sleep(interval_sec)
    with open(file, errors="replace") as fp:
        pending = ""
        while True:
            piece = fp.readline()
            if piece:
                pending += piece
                if not pending.endswith("\n"):
                    continue  # the rest of this line is still being written
                if log_line_filter is None or log_line_filter(pending):
                    dst.write(_prefixed(header, pending))
                pending = ""
            elif finished.is_set():
                if pending and (log_line_filter is None or log_line_filter(pending)):
                    dst.write(_prefixed(header, pending) + "\n")  # the worker ended without a newline
                break
            else:
                time.sleep(interval_sec)


def _prefixed(header: str, line: str) -> str:
    """One rank prefix per line: torch's own exception hook in a worker that joined a process
    group already writes `[rank0]: ` before each traceback line, as torchrun shows it."""
    return line if header and line.startswith(header) else f"{header}{line}"
