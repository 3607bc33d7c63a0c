"""Sums and flags across ranks: the one place that chooses how a small all-reduce travels.

A job whose DDP gradients are summed in shared memory (strategies/grad_sync.py) hands its
mapping to the Runtime's Collectives; from then on the loop's small all-reduces (loss sums,
NaN/stop flags, evaluation counts) go through it (~1 us instead of gloo's ~0.3 ms). Every
rank of a job decides alike: the mapping exists on all ranks or on none.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .record import CollectiveRecord

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class Collectives:
    """All-reduces of this process's job, through the shared mapping when it can serve them,
    each one written to `record` (what a hang report shows: record.py)."""

    def __init__(self, record: CollectiveRecord | None = None) -> None:
        self.record = record if record is not None else CollectiveRecord()
        self.shm: Any = None  # runtime.shm.ShmAllReduce of this job, once the model is wrapped

    def use_shared_memory(self, mapping: Any) -> None:
        """From now on small all-reduces go through `mapping`; its gradient buckets are
        written to this record too."""
        mapping.record = self.record
        self.shm = mapping

    def all_reduce_(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place, over every rank of the job (identity without a process group)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return t
        shm = self.shm
        name = "all_reduce" if op == "sum" else f"all_reduce({op})"
        mapping = shm is not None and shm.group is dist.group.WORLD
        with self.record.track(
            name, t, "shm" if mapping else "backend"
        ) as entry:  # what a hang report shows (record.py)
            if mapping and shm.all_reduce_small(t, op):
                return t
            entry.path = "backend"
            dist.all_reduce(t, op=_OPS[op])
        return t

    def all_sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum over all ranks, as a new tensor."""
        return self.all_reduce_(value.detach().clone())
