"""Stop requests from signals (SLURM's time-limit warning, preemption, SIGTERM): the handler
only sets a flag; the trainer asks all ranks at the next step boundary, saves, and stops."""

from __future__ import annotations

import signal
from types import FrameType


class StopRequest:
    """Installs handlers for the named signals (e.g. ["USR1", "TERM"]); the trainer asks at
    each step boundary, through one all-reduce, whether ANY rank received one."""

    def __init__(self, names: list[str]) -> None:
        self.received: str | None = None
        self.names = [n.upper().removeprefix("SIG") for n in names if n]
        self._previous: dict[int, object] = {}
        for name in self.names:
            signum = getattr(signal, f"SIG{name}")
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum).name

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()
