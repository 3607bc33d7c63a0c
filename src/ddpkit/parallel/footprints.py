"""What a rank holds of the model's state under a strategy: the strategies' memory models.

A memory model maps the model's sizes (ModelSizes: each parameter's shape, the optimizer's
bytes per element, FSDP's blocks) and a (replicate, shard) layout to a Footprint, the bytes
of parameters, gradients, optimizer state and what is in flight per rank. Each registered
strategy names its model (strategy_config.StrategySpec.memory); the memory plan
(planning/memory.py, `ddpkit plan`) measures the sizes with torch and asks every model.
No torch here: the registry that names these sits below config/.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Footprint:
    """Bytes one rank holds."""

    params: int
    grads: int
    optimizer: int
    transient: int  # all-gathered units (FSDP) or autocast's weight copies (DDP bf16)

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.state + self.transient


@dataclass(frozen=True)
class ModelSizes:
    """The model as the memory models see it: sizes only, measured once by the plan."""

    shapes: tuple[tuple[tuple[int, ...], int], ...]  # each parameter's shape and bytes per element
    optimizer_bytes: float  # optimizer state per parameter element
    precision: str
    root: int = 0  # parameter elements outside FSDP's blocks (the root unit)
    largest_block: int = 0  # elements of the largest block
    blocks: int = 0

    @property
    def compute_bytes(self) -> int:
        return 2 if self.precision == "bf16" else 4

    def numel(self, shards: int = 1) -> int:
        """Elements a rank keeps when every parameter is split over `shards` ranks (1: whole)."""
        return sum(shard_numel(shape, shards) for shape, _ in self.shapes)

    def nbytes(self, shards: int = 1) -> int:
        return sum(shard_numel(shape, shards) * size for shape, size in self.shapes)


MemoryModel = Callable[[ModelSizes, tuple[int, int]], Footprint]


def whole_replica(sizes: ModelSizes, mesh: tuple[int, int]) -> Footprint:
    """DDP: every parameter, its gradient (DDP's buckets hold them: gradient_as_bucket_view)
    and the optimizer state, whole on every rank; with bf16, autocast's bf16 copies of the weights."""
    full, n = sizes.nbytes(), sizes.numel()
    return Footprint(full, full, int(n * sizes.optimizer_bytes), n * 2 if sizes.precision == "bf16" else 0)


def sharded_state(sizes: ModelSizes, mesh: tuple[int, int]) -> Footprint:
    """FSDP over a (replicate, shard) mesh: each parameter's dim-0 shard over `shard` ranks (as
    FSDP2 pads), its gradient and its optimizer state; plus, transiently, the root unit and two
    blocks (one running, one prefetched) all-gathered, and one block's unsharded gradients
    before their reduce-scatter. The replicas hold the same shards."""
    shard = sizes.nbytes(mesh[1])
    in_flight = (sizes.root + min(2, sizes.blocks) * sizes.largest_block) * sizes.compute_bytes
    in_flight += sizes.largest_block * 4
    return Footprint(shard, shard, int(sizes.numel(mesh[1]) * sizes.optimizer_bytes), in_flight)


def cross_node_bytes(sizes: ModelSizes, mesh: tuple[int, int], nnodes: int) -> int:
    """What each rank sends per optimizer step in collectives whose group spans nodes, over a
    (replicate, shard) layout with ranks numbered node by node (ring estimates: (n-1)/n of the
    buffer per gather or reduce-scatter, twice that per all-reduce). Gradients are reduced in
    fp32: the replicas all-reduce their gradient shards; a shard group that spans nodes
    all-gathers the parameters in the compute precision (forward and backward) and
    reduce-scatters the gradients. DDP is (world, 1), FSDP (1, world)."""
    replicate, shard = mesh
    ring = lambda n: (n - 1) / n  # noqa: E731
    across = int(2 * ring(replicate) * sizes.numel(shard) * 4)
    if (replicate * shard // nnodes) % shard == 0:  # each node holds whole shard groups
        return across
    n = sizes.numel()
    return across + int(ring(shard) * (2 * n * sizes.compute_bytes + n * 4))


def shard_numel(shape: tuple[int, ...], shards: int) -> int:
    """Elements of the largest dim-0 shard FSDP2 gives a rank (padded to equal rows)."""
    if not shape:
        return 1
    return math.ceil(shape[0] / shards) * (math.prod(shape) // shape[0] if shape[0] else 0)
