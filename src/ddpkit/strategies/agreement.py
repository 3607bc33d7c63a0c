"""The step's agreement (training/step.py: any loss not finite, any rank asked to stop, the
global count, a timed save due, the run directory taken by another world) carried by the
gradient sync instead of a collective of its own.

Why: a separate all-reduce per optimizer step costs a round trip (on 2 busy CPU cores ~0.3 ms
with gloo, a barrier with shared memory) and, issued before the last backward, makes the
backward wait for it. The ranks must meet once per step anyway, in the gradient sync, so the
few numbers travel with DDP's first bucket (DDP's first bucket is small, ~1 MB, and reduced
first): the backend hook appends them to that bucket's all-reduce, the shared-memory sum adds
them to the same barrier (runtime/shm.py). The runner arms an Agreement before the step's last
backward and collects the sums after it, before the optimizer step; when no hook carried them
(another hook took over, FSDP, one process) it all-reduces them itself, after the backward.

Appending them to a large first bucket costs more than a collective of their own: a new
bucket-sized tensor and two copies of the bucket per step (DDP's first bucket is larger than
~1 MB when one parameter is: the 9.46M-parameter MLP's holds 4.2M elements, whose cat and copy
back take ~3 ms of CPU per step and rank, ~1.5% of its step: benchmarks/results/step_profile.md).
Then the hook issues the flags' own small all-reduce, asynchronously, beside that bucket's: the
backward does not wait for it, and no other collective comes between two steps.

Which path carries them:
  DDP, --grad-sync shm (CPU ranks of one machine, x86)  the shared-memory sum's first barrier
  DDP, the backend's all-reduce (gloo, NCCL)            appended to the first bucket (float32:
                                                        counts exact up to 2**24 per step); a
                                                        first bucket over CARRY_MAX elements: an
                                                        all-reduce of their own, issued with it
  DDP with --grad-compression, a user's hook, a bucket  one small all-reduce after the backward
  not float32/64, compiled autograd; FSDP, HSDP
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

CARRY_MAX = 1 << 20  # elements: a larger first bucket does not carry the flags; they go beside it


class Agreement:
    """This rank's flags for the step's gradient sync to carry (`arm`), and their sums over
    the ranks once it has (`collect`). Also the state of the backend's hook (backend_hook)."""

    def __init__(self, group: Any = None) -> None:
        self.group = dist.group.WORLD if group is None else group
        self.outgoing: torch.Tensor | None = None  # armed, not yet taken by a hook
        self.agreed: torch.Tensor | None = None  # the sums, once a hook has them
        self.delegate: tuple[Any, Any] | None = None  # (hook, state) the user registered after us
        self.waited_s = 0.0  # seconds this rank waited for the gradient sync after its backward, in all
        self._issued = 0.0  # when the last bucket was handed to the backend (backend hook)
        self._done = 0.0  # when the last of its all-reduces completed
        self._beside: tuple[Any, torch.Tensor] | None = None  # (work, flags): their own all-reduce

    def arm(self, flags: torch.Tensor) -> None:
        self.outgoing, self.agreed = flags, None

    def take(self, bucket_index: int) -> torch.Tensor | None:
        """The flags for bucket 0 to carry, once per arming (None: nothing to carry)."""
        if bucket_index != 0 or self.outgoing is None:
            return None
        flags, self.outgoing = self.outgoing, None
        return flags

    def send_beside(self, flags: torch.Tensor) -> None:
        """The flags' own all-reduce, not waited for here (a large first bucket's hook)."""
        self._beside = (dist.all_reduce(flags, group=self.group, async_op=True), flags)

    def collect(self) -> torch.Tensor | None:
        """The sums over the ranks (None: no hook carried them: all-reduce them yourself)."""
        if self._beside is not None:
            (work, flags), self._beside = self._beside, None
            work.wait()
            self.agreed = flags
        agreed, self.agreed, self.outgoing = self.agreed, None, None
        if self._issued:
            self.waited_s += max(0.0, self._done - self._issued)
            self._issued = self._done = 0.0
        return agreed


def backend_hook(state: Agreement, bucket):  # type: ignore[no-untyped-def]  (DDP checks annotations: none here)
    """DDP communication hook: the backend's mean of each bucket, as DDP's own, with the armed
    flags appended to bucket 0 (summed, not divided)."""
    if state.delegate is not None:
        hook, user_state = state.delegate
        return hook(user_state, bucket)
    group = state.group
    world = dist.get_world_size(group)
    if isinstance(bucket, tuple):  # DDP's Python reducer under compiled autograd: (grad, param), in place
        bucket[0].div_(world)
        dist.all_reduce(bucket[0], group=group)
        return None
    grad = bucket.buffer()
    flags = state.take(bucket.index()) if grad.dtype in (torch.float32, torch.float64) else None
    if flags is not None and grad.numel() > CARRY_MAX:
        state.send_beside(flags)
        flags = None
    if flags is None:
        packed, n = grad.div_(world), grad.numel()
    else:
        n = grad.numel()
        packed = torch.cat([grad.view(-1).div_(world), flags.to(device=grad.device, dtype=grad.dtype)])
    state._issued = time.perf_counter()
    work = dist.all_reduce(packed, group=group, async_op=True)

    def done(fut: torch.futures.Future) -> torch.Tensor:
        state._done = max(state._done, time.perf_counter())
        if flags is None:
            return fut.value()[0]
        out = fut.value()[0]
        state.agreed = out[n:].to(torch.float64)
        return grad.copy_(out[:n].view_as(grad))

    return work.get_future().then(done)
