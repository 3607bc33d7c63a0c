"""The plan of a mesh with tensor- and pipeline-parallel dims: what each rank holds and what it
sends on each dim per optimizer step. Arithmetic only (no torch): the sizes come measured
(training/mesh_probe.py: the model at its tp-local shapes, cut into its stages, one forward on the meta
device or the CPU).

Per rank of pipeline stage(s) S (every rank of one pp index holds the same, whatever its tp and
dp coordinates):

- state: S's parameters at their tp-local shapes (a colwise Linear's out_features / tp, a
  rowwise one's in_features / tp, the rest whole), their gradients and optimizer state; under
  FSDP/HSDP sharded over dp_shard as FSDP2 pads (parallel/footprints.py: sharded_state), under
  DDP whole (whole_replica);
- activations: what one micro-batch keeps for backward on S (tp-local, measured), times the
  micro-batches in flight: 1 without --pp; the schedule's count with it (GPipe: every
  micro-batch; 1F1B: pp - stage; interleaved 1F1B: Megatron's warm-up count + 1 of the rank's
  virtual stages, each half the rank's share).

Bytes sent per rank and step, with ring estimates (what a bandwidth-optimal algorithm sends:
all-reduce 2(n-1)/n of the buffer, all-gather (n-1) x the rank's part, reduce-scatter (n-1)/n of
the input); the collectives recorder (runtime/traffic.py) counts the tensors that reach c10d by
the same rules, so the two are compared like for like:

- tp: an all-reduce of each rowwise Linear's output in the forward and of each colwise Linear's
  input gradient in the backward (torch's ColwiseParallel / RowwiseParallel), per micro-batch;
- pp: each micro-batch's values a stage sends the next (forward) and their gradients back;
- dp_shard (FSDP, HSDP): per micro-batch the all-gather of every unit (the root once, as FSDP2
  keeps it gathered for the backward; each block twice, forward and backward), in the compute
  precision; per step the reduce-scatter of the gradients (fp32 under bf16);
- dp_replicate: per step the all-reduce of the gradients (DDP, and the pipeline's flat one) or
  of the gradient shards between HSDP's replicas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config.values import format_bytes
from ..parallel.dims import ParallelDims
from ..parallel.footprints import Footprint, ModelSizes, shard_numel, sharded_state, whole_replica

Shapes = tuple[tuple[tuple[int, ...], int], ...]  # (shape, bytes per element) of each parameter


@dataclass(frozen=True)
class Linear:
    """A figure of a micro-batch of b samples: fixed + b x per_sample bytes."""

    fixed: int = 0
    per_sample: int = 0

    def at(self, b: int) -> int:
        return max(0, self.fixed + b * self.per_sample)


@dataclass(frozen=True)
class StageSizes:
    """One pipeline stage as one tp rank holds and runs it (the whole model without --pp)."""

    sizes: ModelSizes  # its parameters at their tp-local shapes, its FSDP units
    root_shapes: Shapes  # those of its parameters outside every block (its FSDP root unit)
    tp_forward: Linear  # all-reduced over tp in the forward: rowwise outputs
    tp_backward: Linear  # in the backward: colwise inputs' gradients
    send_forward: Linear  # sent to the next stage (0 for the last)
    send_backward: Linear  # gradients sent back to the previous stage (0 for the first)
    activations: Linear  # kept for backward


@dataclass(frozen=True)
class RankPlan:
    """What every rank of one pp index holds and sends."""

    stages: tuple[int, ...]
    state: Footprint
    activations: int  # one micro-batch's, over the rank's stages
    in_flight: float  # micro-batches of them held at once
    fixed: int
    traffic: dict[str, int]  # dim -> bytes sent per step

    @property
    def activations_held(self) -> int:
        return int(self.activations * self.in_flight)

    @property
    def total(self) -> int:
        return self.fixed + self.state.total + self.activations_held


@dataclass(frozen=True)
class MeshPlan:
    dims: ParallelDims
    strategy: str
    precision: str
    micro_batch: int  # samples per micro-batch on one data-parallel rank
    microbatches: int  # per optimizer step (the pipeline's, times --accumulate)
    schedule: str
    ranks: tuple[RankPlan, ...]  # one per pp index
    nnodes: int = 1
    budget: int | None = None
    refused: str | None = None  # what training says of this mesh today (None: it trains)
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def bubble(self) -> float:
        """The share of a step each stage idles (fill and drain of the pipeline)."""
        pp, m = self.dims.pp, self.microbatches
        v = 2 if self.schedule == "interleaved-1f1b" and pp > 1 else 1
        return (pp - 1) / (v * m + pp - 1) if pp > 1 else 0.0

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.microbatches * self.dims.dp

    @property
    def peak(self) -> int:
        return max(r.total for r in self.ranks)

    def fits(self, fraction: float) -> bool | None:
        return None if self.budget is None else self.peak <= fraction * self.budget

    def as_dict(self) -> dict[str, Any]:
        d = self.dims
        return {
            "mesh": {n: getattr(d, n) for n in ("pp", "dp_replicate", "dp_shard", "tp")},
            "world_size": d.world_size,
            "nnodes": self.nnodes,
            "strategy": self.strategy,
            "precision": self.precision,
            "micro_batch": self.micro_batch,
            "microbatches": self.microbatches,
            "global_batch": self.global_batch,
            "schedule": self.schedule,
            "bubble": round(self.bubble, 4),
            "per_stage": [
                {
                    "pp_rank": i,
                    "stages": list(r.stages),
                    "params": r.state.params,
                    "grads": r.state.grads,
                    "optimizer": r.state.optimizer,
                    "in_flight_units": r.state.transient,
                    "activations_per_microbatch": r.activations,
                    "microbatches_in_flight": r.in_flight,
                    "activations": r.activations_held,
                    "fixed": r.fixed,
                    "total": r.total,
                    "sent_per_step": dict(r.traffic),
                }
                for i, r in enumerate(self.ranks)
            ],
            "peak": self.peak,
            "device_memory": self.budget,
            "refused": self.refused,
        }


def ring_all_reduce(nbytes: float, n: int) -> float:
    return 2 * (n - 1) * nbytes / n if n > 1 else 0.0


def ring_all_gather(part: float, n: int) -> float:
    """Sent by a rank whose part of the gathered buffer is `part` bytes."""
    return (n - 1) * part if n > 1 else 0.0


def ring_reduce_scatter(nbytes: float, n: int) -> float:
    """Sent by a rank whose input (the whole buffer) is `nbytes`."""
    return (n - 1) * nbytes / n if n > 1 else 0.0


def in_flight(schedule: str, pp_rank: int, pp: int, microbatches: int) -> float:
    """Micro-batches of the rank's activations held at once (in units of the rank's whole share:
    an interleaved rank's chunks are half of it each). ddpkit falls back as torch needs: 1F1B
    with fewer micro-batches than stages runs as GPipe, interleaved as looped breadth-first."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe" or microbatches < pp:
        return float(microbatches)
    if schedule == "1f1b":
        return float(min(microbatches, pp - pp_rank))
    v = 2  # the interleaved schedule's stages per rank (strategies/pipeline.py)
    chunks = min(microbatches * v, (pp - pp_rank - 1) * 2 + (v - 1) * pp + 1)
    return chunks / v


def _bytes(shapes: Shapes, shards: int, element: int | None = None) -> int:
    return sum(shard_numel(shape, shards) * (element or size) for shape, size in shapes)


def _merged(stages: list[StageSizes]) -> tuple[ModelSizes, Shapes]:
    """The stages one rank holds, as one model (the interleaved schedule's two)."""
    if len(stages) == 1:
        return stages[0].sizes, stages[0].root_shapes
    first = stages[0].sizes
    sizes = ModelSizes(
        tuple(s for st in stages for s in st.sizes.shapes),
        first.optimizer_bytes,
        first.precision,
        root=sum(st.sizes.root for st in stages),
        largest_block=max(st.sizes.largest_block for st in stages),
        blocks=sum(st.sizes.blocks for st in stages),
    )
    return sizes, tuple(s for st in stages for s in st.root_shapes)


def traffic(
    stages: list[StageSizes], dims: ParallelDims, sharded: bool, micro_batch: int, microbatches: int, bf16: bool
) -> dict[str, int]:
    """Bytes one rank holding `stages` sends per step on each dim in use (see the module docstring)."""
    sizes, root = _merged(stages)
    b, m = micro_batch, microbatches
    out: dict[str, float] = {}
    if dims.tp > 1:
        per_micro = sum(st.tp_forward.at(b) + st.tp_backward.at(b) for st in stages)
        out["tp"] = m * ring_all_reduce(per_micro, dims.tp)
    if dims.pp > 1:
        out["pp"] = m * sum(st.send_forward.at(b) + st.send_backward.at(b) for st in stages)
    compute = 2 if bf16 else None  # the all-gathers' element size (None: the parameter's own)
    reduce = 4 if bf16 else None  # the gradients' reduction dtype
    if sharded:
        s, r = dims.dp_shard, dims.dp_replicate
        root_part, whole_part = _bytes(root, s, compute), _bytes(sizes.shapes, s, compute)
        gathered = root_part + 2 * (whole_part - root_part)  # the root once, each block twice
        grads = _bytes(sizes.shapes, s, reduce)
        if s > 1:
            out["dp_shard"] = m * ring_all_gather(gathered, s) + ring_reduce_scatter(s * grads, s)
        if r > 1:
            out["dp_replicate"] = ring_all_reduce(grads, r)
    elif dims.dp_replicate > 1:
        out["dp_replicate"] = ring_all_reduce(_bytes(sizes.shapes, 1, reduce), dims.dp_replicate)
    return {k: int(v) for k, v in out.items()}


def plan_mesh(
    stages: list[StageSizes],
    dims: ParallelDims,
    *,
    strategy: str,
    micro_batch: int,
    microbatches: int,
    schedule: str = "1f1b",
    accumulate: int = 1,
    fixed: int = 0,
    nnodes: int = 1,
    budget: int | None = None,
    refused: str | None = None,
) -> MeshPlan:
    """The plan of `stages` (pp x its stages per rank, in order) on `dims` under `strategy`
    (ddp, fsdp, hsdp: what the data-parallel ranks do), `micro_batch` samples per micro-batch,
    `microbatches` of them per pipeline step (1 without --pp), `accumulate` steps of them."""
    per_rank = len(stages) // dims.pp
    if per_rank * dims.pp != len(stages) or per_rank < 1:
        raise ValueError(f"{len(stages)} stages do not spread evenly over pp {dims.pp}")
    sharded = strategy in ("fsdp", "hsdp")
    precision = stages[0].sizes.precision
    ranks = []
    for r in range(dims.pp):
        own = [stages[r + dims.pp * k] for k in range(per_rank)]
        sizes, _ = _merged(own)
        state = sharded_state(sizes, (dims.dp_replicate, dims.dp_shard)) if sharded else whole_replica(sizes, (0, 0))
        sent = traffic(own, dims, sharded, micro_batch, microbatches * accumulate, precision == "bf16")
        ranks.append(
            RankPlan(
                tuple(r + dims.pp * k for k in range(per_rank)),
                state,
                sum(st.activations.at(micro_batch) for st in own),
                in_flight(schedule, r, dims.pp, microbatches),
                fixed,
                sent,
            )
        )
    return MeshPlan(
        dims,
        strategy,
        precision,
        micro_batch,
        microbatches * accumulate,
        schedule,
        tuple(ranks),
        nnodes=nnodes,
        budget=budget,
        refused=refused,
    )


DIM_WORDS = {
    "tp": "activations all-reduced (rowwise outputs forward, colwise input gradients backward)",
    "pp": "activations to the next stage and their gradients back, per micro-batch",
    "dp_shard": "FSDP's all-gathers of the tp-local shards + the gradients' reduce-scatter",
    "dp_replicate": "the gradients' all-reduce between replicas",
}


def format_mesh(plan: MeshPlan, title: str, fraction: float = 0.9) -> str:
    """The table `ddpkit plan` prints for a mesh with tp or pp."""
    d = plan.dims
    heads = [f"stage {', '.join(map(str, r.stages))}" for r in plan.ranks] if d.pp > 1 else ["every rank"]
    lines = [
        f"mesh plan: {title}, {d.world_size} processes on {plan.nnodes} node(s): {d.describe()} "
        f"(--strategy {plan.strategy}), {plan.precision}",
        f"  batch            {plan.micro_batch} sample(s) per micro-batch x {plan.microbatches} per step x dp {d.dp}"
        f" = global batch {plan.global_batch}"
        + (f"; {plan.schedule}, bubble {plan.bubble:.0%} of each step" if d.pp > 1 else ""),
        "  per rank         " + "".join(f"{h:>16}" for h in heads),
    ]

    def row(label: str, values: list[int], note: str = "") -> None:
        lines.append(
            f"  {label:<17}" + "".join(f"{format_bytes(v):>16}" for v in values) + (f"   ({note})" if note else "")
        )

    row(
        "parameters",
        [r.state.params for r in plan.ranks],
        f"tp-local{', sharded over dp_shard' if d.dp_shard > 1 else ''}",
    )
    row("gradients", [r.state.grads for r in plan.ranks])
    row("optimizer state", [r.state.optimizer for r in plan.ranks])
    row("in flight", [r.state.transient for r in plan.ranks], "FSDP's gathered units" if plan.strategy != "ddp" else "")
    counts = ", ".join(f"{r.in_flight:g}" for r in plan.ranks)
    row("activations", [r.activations_held for r in plan.ranks], f"one micro-batch's x {counts} in flight")
    row("fixed cost", [r.fixed for r in plan.ranks])
    row("peak", [r.total for r in plan.ranks])
    lines.append("  sent per step    (ring estimates, per rank)")
    for dim in ("tp", "pp", "dp_shard", "dp_replicate"):
        if getattr(d, dim) > 1:
            row(f"{dim} ({getattr(d, dim)})", [r.traffic.get(dim, 0) for r in plan.ranks], DIM_WORDS[dim])
    if plan.budget is not None:
        verdict = "fits" if plan.fits(fraction) else "does not fit"
        lines.append(
            f"  device           {format_bytes(plan.budget)} per rank: peak {format_bytes(plan.peak)} {verdict}"
        )
    if plan.refused:
        lines.append(f"  not trainable yet: {plan.refused}")
    lines.extend(f"  {n}" for n in plan.notes)
    return "\n".join(lines)
