"""The step's agreed flags on their way to the host, read one step later: how a training step
runs without a host synchronisation (training/step.py).

Why: reading a GPU tensor on the host (.item(), .tolist(), .cpu()) makes the host wait until
the GPU has run everything queued before it; the host then has nothing queued while it
prepares the next step, and the GPU idles. The step's agreement (a small all-reduce of
[non-finite loss, stop asked, count, timed save due, run directory taken]) is needed on the
host only for decisions a step later can make as well: stop at a step boundary, raise under
--on-nan stop, count a skipped step. What protects the weights is decided on the device
(step.py: the optimizer's found_inf).

How: after step k's optimizer step is queued, its agreed flags are copied into pinned host
memory without waiting (non_blocking), behind a CUDA event. At the end of step k+1 (its
kernels queued) the host waits for that event, which completed long before while the GPU ran
step k+1's work, and reads the copy: no stream or device synchronisation, and the GPU always
has a step queued. On a CPU the copy is a plain one. Every rank reads the same reduced
numbers at the same step, so every rank takes the same decision at the same boundary.
"""

from __future__ import annotations

from typing import Any

import torch


class HostFlags:
    """One step's agreed flags, copied to the host without waiting (`send`) and read later
    (`receive`); one buffer, reused: a step's flags are received before the next are sent."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None  # pinned on CUDA: the only tensor a step reads on the host
        self._event: Any = None  # CUDA: recorded after each copy
        self._waiting = False
        self.where: str | None = None  # the step the flags belong to ("epoch 3, step 7")
        self.pending = False

    def send(self, agreed: torch.Tensor, where: str) -> None:
        if self.buffer is None or self.buffer.shape != agreed.shape:
            pin = agreed.device.type == "cuda"
            self.buffer = torch.empty(agreed.shape, dtype=agreed.dtype, pin_memory=pin)
        if agreed.device.type == "cuda":
            self.buffer.copy_(agreed.detach(), non_blocking=True)
            self._event = self._event or torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(agreed.device))
            self._waiting = True
        else:
            self.buffer.copy_(agreed.detach())
        self.where, self.pending = where, True

    def receive(self) -> tuple[list[float], str] | None:
        """The flags sent last and their step (None: nothing pending); waits for their copy only."""
        if not self.pending:
            return None
        self.pending = False
        if self._waiting:  # for the copy of the step before only: done while this step's kernels ran
            if not self._event.query():
                self._event.synchronize()
            self._waiting = False
        assert self.buffer is not None and self.where is not None
        return self.buffer.tolist(), self.where
