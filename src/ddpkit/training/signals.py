"""Stop requests from signals (SLURM's time-limit warning, preemption, SIGTERM): the handler
only sets a flag; the trainer asks all ranks at the next step boundary, saves, and stops.

Nothing is saved, printed or requeued inside a handler: a signal may arrive anywhere, also
while a checkpoint is being written. A second signal changes nothing: the first one decides
(a warning followed by the scheduler's SIGTERM still asks for the requeue the warning meant),
and the handlers stay in place until the worker has handed over its stop, so a late signal
cannot kill the process between the checkpoint and the requeue request."""

from __future__ import annotations

import signal
from types import FrameType

# What a scheduler or a user sends to END a job (scancel, preemption, a requeue from outside,
# Ctrl-C): save and stop, but never requeue, or a cancelled job would come back.
ENDING_SIGNALS = frozenset({"SIGTERM", "SIGINT"})


class StopRequest:
    """Installs handlers for the named signals (e.g. ["USR1", "TERM"]); the trainer asks at
    each step boundary, through one all-reduce, whether ANY rank received one."""

    def __init__(self, names: list[str]) -> None:
        self.received: str | None = None  # the first signal
        self.repeats = 0  # signals after the first one (ignored)
        self.names = [n.upper().removeprefix("SIG") for n in names if n]
        self._previous: dict[int, object] = {}
        for name in self.names:
            signum = getattr(signal, f"SIG{name}")
            self._previous[signum] = previous = signal.signal(signum, self._handle)
            early = getattr(previous, "__self__", None)
            if isinstance(early, StopRequest) and early.received and self.received is None:
                self.received = early.received  # came while the process started: see install_early

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
        else:
            self.repeats += 1

    @property
    def wants_requeue(self) -> bool:
        """Not stopped by a signal that ends the job (None: another rank received the signal)."""
        return self.received not in ENDING_SIGNALS

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def __enter__(self) -> StopRequest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def install_early(names: list[str]) -> None:
    """For a process that is itself the worker (an srun task): a signal that arrives while it
    starts (torch loading, the process group forming) is kept, and the worker's StopRequest
    takes it over, instead of the signal's default action killing the process."""
    StopRequest(names)
