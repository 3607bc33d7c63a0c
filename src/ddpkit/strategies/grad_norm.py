"""The global gradient norm over parameters that live on different meshes (FSDP x TP: the split
Linears are DTensors on the (dp_shard, tp) mesh, the norms and embeddings on the dp_shard mesh
alone), which torch's clip_grad_norm_ refuses to stack ("must have the same mesh").

Each rank adds the squares of its local pieces, each weighted by how many ranks hold a copy of
that piece (a tensor sharded over S of the W ranks is held by W / S of them: its pieces enter
the sum W / S times), and one all-reduce sums them: the norm of the whole gradient, the same
on every rank, whatever the mesh.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def _local_piece(grad: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's piece of `grad`, over how many ranks the whole is split: every placement that
    is not Replicate is a split, FSDP's _StridedShard over a tp-split dim included)."""
    if not isinstance(grad, DTensor):
        return grad, 1
    placements = [Replicate() if p.is_partial() else p for p in grad.placements]
    if list(placements) != list(grad.placements):  # a pending sum: completed before it is measured
        grad = grad.redistribute(grad.device_mesh, placements)
    shards = math.prod(grad.device_mesh.size(i) for i, p in enumerate(placements) if not p.is_replicate())
    return grad.to_local(), shards


def clip_global_norm_(params: Iterable[torch.nn.Parameter], max_norm: float, world_size: int) -> torch.Tensor:
    """Clip the gradients of `params` to a total 2-norm of `max_norm` (in place); returns the norm
    before clipping, a plain tensor on the gradients' device. Collective over every rank."""
    pieces = [_local_piece(p.grad) for p in params if p.grad is not None]
    if not pieces:
        return torch.zeros(())
    device = pieces[0][0].device
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for local, shards in pieces:
        squares += local.detach().double().pow(2).sum() * (shards / world_size)
    if world_size > 1:
        dist.all_reduce(squares)
    norm = squares.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for local, _ in pieces:
        local.mul_(coef.to(local.dtype))
    return norm.to(pieces[0][0].dtype)
