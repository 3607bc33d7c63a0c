"""Memory: the plan before a run (which strategy fits) and the measurement after it.

The guide's rule: if model, optimizer and batch fit on one device, use DDP (fastest); if
not, FSDP, which shards parameters, gradients and optimizer state over the N ranks at the
price of more communication. The plan measures the model once (strategy_memory.ModelSizes)
and asks each registered strategy's memory model (strategy_config.StrategySpec.memory) over
its (replicate, shard) layout; a column per strategy: DDP and FSDP always, and the one asked
for (hsdp, a plugin's). The built-in models count, per rank:

- DDP: every parameter, its gradient (DDP's buckets hold them: gradient_as_bucket_view)
  and the optimizer state, whole; with bf16, autocast's bf16 copies of the weights.
- FSDP: each parameter's dim-0 shard (ceil(rows / N) rows, as FSDP2 pads), the gradient
  shard and the optimizer state of the shard; plus, transiently, the units in flight:
  the root unit and two blocks (one running, one prefetched) all-gathered, and one
  block's unsharded gradients before their reduce-scatter.
- Setting up: an eager build holds the whole model on every rank before it is sharded; a
  build on the meta device only this rank's shards and, for a moment, one block full-size.

The optimizer's state per parameter element is measured by stepping the task's optimizer
once on a small probe tensor (Adam: 8 bytes, SGD with momentum: 4, plain SGD: 0).
Activations and the batch are not in the total: a strategy "fits" when the plan's total is
at most FIT_FRACTION of the device's memory, leaving the rest for them.

HSDP over a (replicate R, shard S) mesh holds FSDP's state sharded over S instead of N. On
several nodes the plan also counts what each rank sends per optimizer step in collectives
whose group spans nodes (ring estimates): DDP's all-reduce of every gradient, FSDP's
all-gathers (forward and backward) and reduce-scatter over all ranks, and HSDP's all-reduce
of the 1/S gradient shards between replicas (its gathers and reduce-scatters stay inside a
node when each node holds whole shard groups).

The activations are shown beside the state when ddpkit plan (or --dry-run) could measure
them (ActivationEstimate: what one forward of the task's first samples keeps for backward,
training/probe.py), with and without --activation-checkpointing, and the plan warns when
they need more than the rest.
"""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..config.values import format_bytes
from ..strategy_config import StrategyConfig, StrategySpec, strategy_spec, strategy_specs
from ..strategy_memory import Footprint, ModelSizes, cross_node_bytes

FIT_FRACTION = 0.8
ASSUMED_OPTIMIZER_BYTES = 8.0  # Adam's two fp32 moments, when the optimizer cannot be probed


def detect_device_memory(device_type: str, local_procs: int) -> tuple[int, str]:
    """This rank's memory budget: the GPU's, or the machine's RAM shared by the local processes."""
    if device_type == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return int(props.total_memory), f"{props.name}"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:  # a container's limit, when it has one
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    procs = max(1, local_procs)
    return total // procs, f"CPU RAM {format_bytes(total)}" + (f" / {procs} processes" if procs > 1 else "")


def optimizer_state_per_param(spec: Any) -> tuple[str, float, bool]:
    """(name, bytes of optimizer state per parameter element, measured?) of the task's optimizer."""
    name = type(spec).__name__ if isinstance(spec, torch.optim.Optimizer) else "optimizer"
    probe = nn.Parameter(torch.zeros(64))
    try:
        opt = type(spec)([probe], **spec.defaults) if isinstance(spec, torch.optim.Optimizer) else spec([probe])
        name = type(opt).__name__
        probe.grad = torch.full_like(probe, 1e-3)
        opt.step()
        size = sum(
            t.numel() * t.element_size()
            for s in opt.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.numel() == probe.numel()
        )
        return name, size / probe.numel(), True
    except Exception:
        return name, ASSUMED_OPTIMIZER_BYTES, False


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes one rank keeps for backward at `batch_size` samples per micro-batch (the same
    under DDP and FSDP: sharding splits the model, not the batch)."""

    batch_size: int
    kept: int  # everything autograd saves
    kept_checkpointed: int | None  # with checkpointing: what lies outside the blocks, and their inputs
    recomputed: int  # and, during backward, one block's recomputed activations at a time
    precision: str = "fp32"  # what the probe's forward ran in (bf16 and fp16: under autocast)

    def need(self, checkpointing: bool) -> int:
        if checkpointing and self.kept_checkpointed is not None:
            return self.kept_checkpointed + self.recomputed
        return self.kept


@dataclass(frozen=True)
class MemoryPlan:
    n_params: int
    world_size: int
    precision: str
    optimizer: str
    optimizer_bytes_per_param: float
    optimizer_measured: bool
    units: int
    largest_block: int
    # by strategy name, in the registry's order: every `planned` strategy's and the one asked
    # for (each registered strategy's memory model over its (replicate, shard) layout)
    footprints: dict[str, Footprint]
    meshes: dict[str, tuple[int, int]]
    device_memory: int
    device: str
    asked: str = "auto"  # the strategy the plan was made for
    nnodes: int = 1
    cross_node: dict[str, int] = field(default_factory=dict)  # bytes per rank per step, by strategy
    # the peak of building the model, per rank: eager, every rank holds the whole model first;
    # on the meta device (strategies/materialize.py), its shards and one block full-size at a time
    setup_eager: int = 0
    setup_meta: int = 0
    built_on_meta: bool = False
    activations: ActivationEstimate | str | None = None  # or why it could not be measured
    checkpointing: bool = False  # --activation-checkpointing

    def __getattr__(self, name: str) -> Footprint | None:
        """A registered strategy's footprint by its name (plan.ddp, plan.hsdp); None when this
        plan did not plan it."""
        if name.startswith("_") or name in ("footprints", "meshes"):
            raise AttributeError(name)
        if name not in {s.name for s in strategy_specs() if s.memory is not None}:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return self.footprints.get(name)

    @property
    def mesh(self) -> tuple[int, int] | None:
        """The (replicate, shard) mesh of the strategy asked for, when it takes --replicate."""
        spec = next((s for s in strategy_specs() if s.name == self.asked), None)
        return self.meshes.get(self.asked) if spec is not None and spec.replicas else None

    def fits(self, strategy: str) -> bool:
        return self.footprints[strategy].total <= FIT_FRACTION * self.device_memory

    def choose(self) -> str:
        """'ddp' when it fits (the fastest), else 'fsdp' (if there are ranks to shard over)."""
        if self.world_size < 2 or self.fits("ddp"):
            return "ddp"
        return "fsdp"

    def reason(self) -> str:
        need = lambda s: format_bytes(self.footprints[s].total)  # noqa: E731
        budget = (
            f"{format_bytes(FIT_FRACTION * self.device_memory)} "
            f"({FIT_FRACTION:.0%} of {format_bytes(self.device_memory)})"
        )
        if self.fits("ddp"):
            return f"ddp: DDP needs {need('ddp')} per rank, within {budget}; it is the fastest"
        if self.world_size < 2:
            return (
                f"ddp, but DDP needs {need('ddp')}, more than {budget}: expect out-of-memory; "
                "run on several processes with --strategy fsdp"
            )
        if self.fits("fsdp"):
            return (
                f"fsdp: DDP needs {need('ddp')} per rank, more than {budget}; "
                f"FSDP over {self.world_size} ranks needs {need('fsdp')}"
            )
        return (
            f"fsdp, but even FSDP over {self.world_size} ranks needs {need('fsdp')} per rank, more than {budget}: "
            "expect out-of-memory; use more processes or a smaller batch"
        )

    def verdict(self, strategy: str) -> str:
        """The last line of the plan: what `strategy` would do here."""
        spec = strategy_spec(strategy)
        if spec.memory is None:
            return self.reason()
        if spec.shards and self.world_size < 2:
            return f"{strategy.upper()} needs 2 or more processes (--nproc 2+)"
        need = format_bytes(self.footprints[strategy].total)
        if self.fits(strategy):
            return f"{strategy.upper()} needs {need} per rank: fits"
        return f"{strategy.upper()} needs {need} per rank: does not fit; --strategy auto would pick {self.choose()}"

    def _columns(self) -> list[tuple[StrategySpec, Footprint, int]]:
        """(strategy, footprint, width) of each column: the first two as wide as DDP's and FSDP's."""
        specs = [s for s in strategy_specs() if s.name in self.footprints]
        return [(s, self.footprints[s.name], (11, 15)[i] if i < 2 else 13) for i, s in enumerate(specs)]

    def format(self, title: str, strategy: str = "auto") -> str:
        n = self.world_size
        opt = f"{self.optimizer}, {self.optimizer_bytes_per_param:g} bytes of state per parameter" + (
            "" if self.optimizer_measured else " (assumed: it could not be probed)"
        )
        cols = self._columns()
        row = lambda cells: "  ".join(f"{c:>{w}}" for c, (_, _, w) in zip(cells, cols, strict=True))  # noqa: E731
        value = lambda attr: [format_bytes(getattr(f, attr)) for _, f, _ in cols]  # noqa: E731
        first, second = cols[0][0].title, cols[1][0].title
        lines = [
            f"memory plan: {title}, {n} process{'es' if n != 1 else ''}, {self.precision}",
            f"  model            {self.n_params:,} parameters, "
            f"{self.units} FSDP units (largest block {self.largest_block:,})",
            f"  optimizer        {opt}",
            "  per rank         " + row([s.column(self.meshes[s.name]) for s, _, _ in cols]),
        ]
        for label, attr in (
            ("parameters", "params"),
            ("gradients", "grads"),
            ("optimizer state", "optimizer"),
            ("model state", "state"),
        ):
            d, f = getattr(cols[0][1], attr), getattr(cols[1][1], attr)
            ratio = f"   ({second}/{first} {f / d:.2f})" if attr == "state" and d else ""
            lines.append(f"  {label:<16} " + row(value(attr)) + ratio)
        in_flight = [format_bytes(f.transient) if f.transient else "-" for _, f, _ in cols]
        lines.append(
            f"  {'in flight':<16} " + row(in_flight) + "   (FSDP: gathered units; DDP bf16: autocast's weight copies)"
        )
        lines.append(f"  {'total':<16} " + row(value("total")))
        mark = lambda meta: "   <- this task" if meta == self.built_on_meta else ""  # noqa: E731
        eager, meta = format_bytes(self.setup_eager), format_bytes(self.setup_meta)
        lines.append(
            f"  {'setup, eager':<16} {eager:>11}  {eager:>15}   (every rank builds the whole model){mark(False)}"
        )
        lines.append(
            f"  {'setup, meta':<16} {eager:>11}  {meta:>15}   (built on the meta device: the shards "
            f"+ the largest block){mark(True)}"
        )
        if self.nnodes > 1 and self.cross_node:
            lines.append(
                f"  {'across nodes':<16} "
                + row([format_bytes(self.cross_node[s.name]) for s, _, _ in cols])
                + f"   (sent per rank per step between the {self.nnodes} nodes; HSDP: only its all-reduce of "
                "gradient shards)"
            )
        fits = ", ".join(f"{s.title} {'yes' if self.fits(s.name) else 'no'}" for s, _, _ in cols)
        lines.append(f"  device           {format_bytes(self.device_memory)} per rank ({self.device})")
        lines.append(
            f"  fits in {FIT_FRACTION:.0%}      {fits} (the other {1 - FIT_FRACTION:.0%} is for activations and the "
            "batch)"
        )
        lines.extend(self._activation_lines())
        lines.append(f"  --strategy {strategy:<5} {self.verdict(strategy)}")
        return "\n".join(lines)

    def _activation_lines(self) -> list[str]:
        a = self.activations
        if a is None:
            return []
        if isinstance(a, str):
            return [f"  activations      not estimated: {a}"]
        with_ckpt = (
            f"{format_bytes(a.kept_checkpointed)} + {format_bytes(a.recomputed)} while a block is recomputed"
            if a.kept_checkpointed is not None
            else "no blocks to checkpoint"
        )
        lines = [
            f"  activations      {format_bytes(a.kept)} per rank at --batch-size {a.batch_size}"
            + ("" if a.precision == "fp32" else f" in {a.precision} (autocast)")
            + ", kept for backward (DDP and FSDP alike)",
            f"  checkpointed     {with_ckpt} (--activation-checkpointing{', on' if self.checkpointing else ''})",
        ]
        room = (1 - FIT_FRACTION) * self.device_memory
        if a.need(self.checkpointing) > room:
            lines.append(
                f"  warning          the activations need more than the {format_bytes(room)} left beside the "
                "model state: expect out-of-memory; use a smaller --batch-size"
                + ("" if self.checkpointing else " or --activation-checkpointing")
            )
        return lines


def make_plan(
    model: nn.Module,
    optimizer: Any,
    world_size: int,
    precision: str,
    device_memory: int,
    device: str,
    blocks: Callable[[nn.Module], Iterable[nn.Module]] | None = None,
    *,
    strategy: str = "auto",
    replicate: int | None = None,
    nnodes: int = 1,
    activations: ActivationEstimate | str | None = None,
    checkpointing: bool = False,
) -> MemoryPlan:
    """Per-rank bytes of the model's state at this world size under every registered strategy
    that is `planned` (DDP, FSDP) and under `strategy` (e.g. hsdp with `replicate` replicas),
    each by its memory model over its layout. `blocks` names FSDP's units
    (ddpkit.fsdp.default_blocks, or the task's hook); None: the root only. `nnodes`: how many
    nodes the ranks span (the world size split evenly), for the traffic between them.
    `activations`: measured apart (training/probe.py), shown beside the state.
    Long: the model's sizes, then one call naming each of MemoryPlan's figures; split, the same
    dozen values would only be handed from one function to the next."""
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    name, per_param, measured = optimizer_state_per_param(optimizer)
    block_list = list(blocks(model)) if blocks else []
    block_sizes = [sum(p.numel() for p in b.parameters()) for b in block_list]
    block_bytes = max((sum(p.numel() * p.element_size() for p in b.parameters()) for b in block_list), default=0)
    largest = max(block_sizes, default=0)
    sizes = ModelSizes(
        tuple((tuple(p.shape), p.element_size()) for p in params),
        per_param,
        precision,
        root=n_params - sum(block_sizes),
        largest_block=largest,
        blocks=len(block_sizes),
    )
    specs = [s for s in strategy_specs() if s.memory is not None and (s.planned or s.name == strategy)]
    config = lambda s: StrategyConfig(name=s.name, replicate=replicate if s.name == strategy else None)  # noqa: E731
    meshes = {s.name: s.mesh(config(s), world_size, nnodes) for s in specs}
    full, setup_shard = sizes.nbytes(), sizes.nbytes(world_size)  # setup: the FSDP column's shards
    return MemoryPlan(
        n_params,
        world_size,
        precision,
        name,
        per_param,
        measured,
        len(block_sizes) + 1,
        largest,
        {s.name: s.memory(sizes, meshes[s.name]) for s in specs},  # type: ignore[misc]
        meshes,
        device_memory,
        device,
        asked=strategy,
        nnodes=nnodes,
        cross_node={s.name: cross_node_bytes(sizes, meshes[s.name], nnodes) for s in specs} if nnodes > 1 else {},
        setup_eager=full,
        setup_meta=setup_shard + (block_bytes or full - setup_shard),
        built_on_meta=any(p.is_meta for p in params),
        activations=activations,
        checkpointing=checkpointing,
    )


def local_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What this rank really holds of the model's state (its shards under FSDP). Gradients
    have the parameters' shapes, so they count as much as the parameters."""
    params = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    optim = sum(
        _local(t).numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    return {"params": params, "grads": params, "optimizer": optim, "total": 2 * params + optim}


def state_bytes_at_start(model: nn.Module, optimizer: torch.optim.Optimizer, spec: Any) -> dict[str, int]:
    """local_state_bytes before the first optimizer step: an optimizer that makes its state at its
    first step (Adam) holds none yet, so its state is counted per parameter element as the plan
    does (optimizer_state_per_param on the task's optimizer `spec`)."""
    state = local_state_bytes(model, optimizer)
    if state["optimizer"] == 0:
        per_element = optimizer_state_per_param(spec)[1]
        elements = sum(_local(p).numel() for p in model.parameters() if p.requires_grad)
        state["optimizer"] = int(per_element * elements)
        state["total"] = 2 * state["params"] + state["optimizer"]
    return state


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def reset_peak_memory(device: torch.device) -> None:
    """Count this run's peak only (a second run in one process must not report the first's)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """This process's peak: CUDA max allocated on a GPU, the resident set's peak on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda max allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), "peak resident set"
