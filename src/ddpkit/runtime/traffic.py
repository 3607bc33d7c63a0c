"""The bytes this rank's collectives send, by the process group they run in: what the mesh plan
(planning/mesh.py) predicts, recorded where every path meets, the c10d ops and torch's functional
collectives (FSDP2's all-gathers and reduce-scatters, DTensor's redistributions, the pipeline's
sends and flat all-reduce, DDP's buckets all reach one of them).

`with TrafficRecorder() as rec: ...` counts each collective issued inside by the ring rules the plan
uses (all-reduce 2(n-1)/n of its buffer, all-gather (n-1) x this rank's part, reduce-scatter
(n-1)/n of its input, all-to-all (n-1)/n, a send its tensors, a broadcast its buffer on the root):
what a bandwidth-optimal algorithm sends, not what gloo's or NCCL's own algorithm chose.
`rec.by_dim(dims)` names each group by the mesh dims whose ranks it holds (parallel/dims.py).
A TorchDispatchMode: it sees the tensors as they reach the collective, DTensor's after DTensor has
turned its redistribution into collectives; it adds ~a microsecond per op, so it is for tests and
benchmarks, not for every run."""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..parallel.dims import DIMS, ParallelDims

_c10d, _fn = torch.ops.c10d, torch.ops._c10d_functional


def _size(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_size(x) for x in t)
    return 0


def _ring_all_reduce(b: int, n: int) -> float:
    return 2 * (n - 1) * b / n


def _gather(b: int, n: int) -> float:
    return (n - 1) * b


def _scatter(b: int, n: int) -> float:
    return (n - 1) * b / n


# op -> (argument holding what this rank contributes, argument naming the group, rule)
_C10D = {
    _c10d.allreduce_: (0, 1, _ring_all_reduce),
    _c10d.allreduce_coalesced_: (0, 1, _ring_all_reduce),
    _c10d._allgather_base_: (1, 2, _gather),
    _c10d.allgather_: (1, 2, _gather),
    _c10d.allgather_into_tensor_coalesced_: (1, 2, _gather),
    _c10d._reduce_scatter_base_: (1, 2, _scatter),
    _c10d.reduce_scatter_: (1, 2, _scatter),
    _c10d.reduce_scatter_tensor_coalesced_: (1, 2, _scatter),
    _c10d.alltoall_base_: (1, 2, _scatter),
    _c10d.send: (0, 1, lambda b, n: b),
}
_FUNCTIONAL = {
    _fn.all_reduce: (0, 2, _ring_all_reduce),
    _fn.all_reduce_coalesced: (0, 2, _ring_all_reduce),
    _fn.all_gather_into_tensor: (0, 2, _gather),
    _fn.all_gather_into_tensor_coalesced: (0, 2, _gather),
    _fn.reduce_scatter_tensor: (0, 3, _scatter),
    _fn.reduce_scatter_tensor_coalesced: (0, 3, _scatter),
    _fn.all_to_all_single: (0, 3, _scatter),
}


class TrafficRecorder(TorchDispatchMode):
    """Bytes sent per process group (its global ranks), and how many collectives, while on."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: dict[tuple[int, ...], float] = defaultdict(float)
        self.count: dict[tuple[int, ...], int] = defaultdict(int)
        self._ranks: dict[Any, tuple[int, ...]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor turn it into collectives, which come back here
        out = func(*args, **(kwargs or {}))
        packet = getattr(func, "_overloadpacket", None)
        rule = _C10D.get(packet) or _FUNCTIONAL.get(packet)
        if rule is not None:
            self._record(packet, args, rule)
        return out

    def _record(self, packet: Any, args: Any, rule: tuple) -> None:
        part, group_at, sent = rule
        ranks = self._group_ranks(args[group_at], functional=packet in _FUNCTIONAL)
        self.sent[ranks] += sent(_size(args[part]), len(ranks))
        self.count[ranks] += 1

    def _group_ranks(self, group: Any, functional: bool) -> tuple[int, ...]:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        # keyed by the group itself: a c10d op's boxed group is a new object per call (its id reused)
        pg = _resolve_process_group(group) if functional else dist.ProcessGroup.unbox(group)
        if pg not in self._ranks:
            self._ranks[pg] = tuple(dist.get_process_group_ranks(pg))
        return self._ranks[pg]

    def totals(self) -> dict[tuple[int, ...], float]:
        return dict(self.sent)

    def by_dim(self, dims: ParallelDims, totals: dict[tuple[int, ...], float] | None = None) -> dict[str, int]:
        """The bytes sent per mesh dim (a group of several dims' ranks: their names joined by
        '+'; the whole world: 'world'; a group of no dims' ranks: its ranks)."""
        names = group_names(dims)
        out: dict[str, float] = defaultdict(float)
        for ranks, b in (totals if totals is not None else self.sent).items():
            out[names.get(tuple(sorted(ranks)), f"ranks {list(ranks)}")] += b
        return {k: int(v) for k, v in out.items()}


def group_names(dims: ParallelDims) -> dict[tuple[int, ...], str]:
    """The ranks of this rank's group on each combination of the dims in use -> its name."""
    used = [n for n in DIMS if getattr(dims, n) > 1]
    names: dict[tuple[int, ...], str] = {}
    for k in range(1, len(used) + 1):
        for combo in itertools.combinations(used, k):
            ranks = tuple(
                r
                for r in range(dims.world_size)
                if all(
                    ParallelDims(dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, r).coordinate(n)
                    == dims.coordinate(n)
                    for n in used
                    if n not in combo
                )
            )
            names.setdefault(ranks, "world" if len(ranks) == dims.world_size else "+".join(combo))
    return names
