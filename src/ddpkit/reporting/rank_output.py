"""What a task prints on each rank under `ddpkit train`: rank 0's lines as they are, every
other rank silent; with --verbose every rank's lines, each written whole (one write per
line) and those of ranks other than 0 prefixed with `[rankN]:`, as `ddpkit launch` tees them.

Why: N processes writing one console through their own buffers interleave wherever a
buffer happens to be flushed, so two ranks' `print`s came out as one cut line
(`number of parameters: 0.10Mnumber of parameters: 0.10M`). Only Python's `sys.stdout` is
covered; stderr (warnings, tracebacks) is left alone, so a failing rank is always heard."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from typing import Iterator


class WholeLines(io.TextIOBase):
    """A text stream that writes complete lines only, each in one os.write to `fd` (a line
    under the pipe's atomic size never mixes with another process's); a line still being
    written waits here for its end. Not a terminal: progress falls back to plain lines."""

    def __init__(self, fd: int, prefix: str = "") -> None:
        self._fd, self._prefix, self._pending = fd, prefix, ""

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._fd

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def write(self, text: str) -> int:
        self._pending += text
        if "\n" in self._pending:
            done, _, self._pending = self._pending.rpartition("\n")
            for line in done.split("\n"):
                self._write_all(f"{self._prefix}{line}\n".encode(errors="replace"))
        return len(text)

    def flush(self) -> None:
        """A partial line stays until its newline: flushing it now is what cuts lines."""

    def finish(self) -> None:
        """The stream is given back: what is left of a last line without a newline goes out."""
        if self._pending:
            pending, self._pending = self._pending, ""
            self._write_all(f"{self._prefix}{pending}\n".encode(errors="replace"))

    def _write_all(self, data: bytes) -> None:
        while data:
            data = data[os.write(self._fd, data) :]


@contextlib.contextmanager
def rank_stdout(rank: int, world_size: int, verbose: bool) -> Iterator[None]:
    """sys.stdout of this rank for the duration of a run (restored after): unchanged alone;
    silent on ranks other than 0; with `verbose`, whole lines from every rank."""
    if world_size <= 1 or (rank == 0 and not verbose):
        yield
        return
    saved = sys.stdout
    saved.flush()
    try:
        fd = saved.fileno()
    except (AttributeError, OSError, ValueError):  # a stdout without a file (captured): leave it
        fd = -1
    if fd < 0 and verbose:
        yield
        return
    stream: io.TextIOBase = WholeLines(fd, "" if rank == 0 else f"[rank{rank}]:") if verbose else open(os.devnull, "w")
    sys.stdout = stream  # type: ignore[assignment]
    try:
        yield
    finally:
        if isinstance(stream, WholeLines):
            stream.finish()
        else:
            stream.close()
        sys.stdout = saved
