"""Stop requests from signals (SLURM's time-limit warning, preemption, SIGTERM): the handler
only sets a flag; the trainer asks all ranks at the next step boundary, saves, and stops."""
from __future__ import annotations

import signal
from types import FrameType

import torch
import torch.distributed as dist


class StopRequest:
    """Installs handlers for the named signals (e.g. ["USR1", "TERM"]) and answers, at a
    step boundary, whether ANY rank received one (so all ranks stop at the same step)."""

    def __init__(self, names: list[str]) -> None:
        self.received: str | None = None
        self.names = [n.upper().removeprefix("SIG") for n in names if n]
        self._previous: dict[int, object] = {}
        for name in self.names:
            signum = getattr(signal, f"SIG{name}")
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum).name

    @property
    def active(self) -> bool:
        return bool(self.names)

    def agreed(self, device: torch.device) -> bool:
        """True on every rank if any rank got a signal. One tiny all-reduce per call, made
        only when handlers are installed."""
        if not self.active:
            return False
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()
