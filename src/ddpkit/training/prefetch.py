"""The next step's batch copied to the GPU while this step computes, and the mark of a host
synchronisation meant to be there (the host's own decision of a step where the device cannot
decide it, training/step.py; between passes).

Why: a copy from pageable host memory to the GPU waits for the GPU (torch copies through a
staging buffer and synchronises); from pinned memory with non_blocking it is queued like a
kernel. On a side stream it overlaps the current step's kernels instead of queueing behind
them. The compute stream waits for the side stream before it uses the batch, and each tensor
is recorded on the compute stream, so the caching allocator does not reuse its memory early.
On a CPU (or any other device) the Prefetcher passes the items through unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch

from ..util.tree import map_tensors


class Prefetcher:
    """Iterates `items` (batch, n_local, n_global) with each batch already on `device`; on
    CUDA the batch after the one just handed out is pinned and its copy queued at once."""

    def __init__(self, items: Iterable[Any], device: torch.device) -> None:
        self.items, self.device = items, device

    def __iter__(self) -> Iterator[Any]:
        if self.device.type != "cuda":
            yield from self.items
            return
        stream = torch.cuda.Stream(self.device)
        it = iter(self.items)
        ahead = self._copy(next(it, None), stream)
        while ahead is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(stream)  # the compute stream uses the batch once its copy is done
            ready = ahead
            map_tensors(ready[0], lambda t, s=current: _record(t, s))
            ahead = self._copy(next(it, None), stream)  # queued now: it runs during this step's kernels
            yield ready

    def _copy(self, item: Any, stream: Any) -> Any:
        if item is None:
            return None
        batch, *rest = item
        with torch.cuda.stream(stream):
            moved = map_tensors(batch, lambda t: _pinned(t).to(self.device, non_blocking=True))
        return (moved, *rest)


def _pinned(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if t.device.type == "cpu" and not t.is_pinned() else t


def _record(t: torch.Tensor, stream: Any) -> torch.Tensor:
    if t.device.type == "cuda":
        t.record_stream(stream)
    return t


@contextlib.contextmanager
def expected_sync() -> Iterator[None]:
    """Around a host synchronisation that is meant to be there: under
    torch.cuda.set_sync_debug_mode (scripts/gpu_check.sh), it is not reported."""
    mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_initialized() else 0
    if mode:
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        if mode:
            torch.cuda.set_sync_debug_mode(mode)
