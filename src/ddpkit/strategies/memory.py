"""Memory: the plan before a run (which strategy fits) and the measurement after it.

The guide's rule: if model, optimizer and batch fit on one device, use DDP (fastest); if
not, FSDP, which shards parameters, gradients and optimizer state over the N ranks at the
price of more communication. The plan counts, per rank:

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

import math
import os
import resource
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..config import format_bytes

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

    def need(self, checkpointing: bool) -> int:
        if checkpointing and self.kept_checkpointed is not None:
            return self.kept_checkpointed + self.recomputed
        return self.kept


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
class MemoryPlan:
    n_params: int
    world_size: int
    precision: str
    optimizer: str
    optimizer_bytes_per_param: float
    optimizer_measured: bool
    units: int
    largest_block: int
    ddp: Footprint
    fsdp: Footprint
    device_memory: int
    device: str
    mesh: tuple[int, int] | None = None  # hsdp's (replicate, shard); None: hsdp not planned
    hsdp: Footprint | None = None
    nnodes: int = 1
    cross_node: dict[str, int] = field(default_factory=dict)  # bytes per rank per step, by strategy
    # the peak of building the model, per rank: eager, every rank holds the whole model first;
    # on the meta device (strategies/materialize.py), its shards and one block full-size at a time
    setup_eager: int = 0
    setup_meta: int = 0
    built_on_meta: bool = False
    activations: ActivationEstimate | str | None = None  # or why it could not be measured
    checkpointing: bool = False  # --activation-checkpointing

    def fits(self, strategy: str) -> bool:
        return getattr(self, strategy).total <= FIT_FRACTION * self.device_memory

    def choose(self) -> str:
        """'ddp' when it fits (the fastest), else 'fsdp' (if there are ranks to shard over)."""
        if self.world_size < 2 or self.fits("ddp"):
            return "ddp"
        return "fsdp"

    def reason(self) -> str:
        need = lambda s: format_bytes(getattr(self, s).total)  # noqa: E731
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
        if strategy == "auto":
            return self.reason()
        if strategy in ("fsdp", "hsdp") and self.world_size < 2:
            return f"{strategy.upper()} needs 2 or more processes (--nproc 2+)"
        need = format_bytes(getattr(self, strategy).total)
        if self.fits(strategy):
            return f"{strategy.upper()} needs {need} per rank: fits"
        return f"{strategy.upper()} needs {need} per rank: does not fit; --strategy auto would pick {self.choose()}"

    def format(self, title: str, strategy: str = "auto") -> str:
        n = self.world_size
        opt = f"{self.optimizer}, {self.optimizer_bytes_per_param:g} bytes of state per parameter" + (
            "" if self.optimizer_measured else " (assumed: it could not be probed)"
        )
        rows = [
            ("parameters", "params"),
            ("gradients", "grads"),
            ("optimizer state", "optimizer"),
            ("model state", "state"),
        ]
        fsdp_head = f"FSDP x{n}" if n > 1 else "FSDP (needs 2+)"
        extra = self._hsdp_column()
        lines = [
            f"memory plan: {title}, {n} process{'es' if n != 1 else ''}, {self.precision}",
            f"  model            {self.n_params:,} parameters, "
            f"{self.units} FSDP units (largest block {self.largest_block:,})",
            f"  optimizer        {opt}",
            f"  per rank         {'DDP':>11}  {fsdp_head:>15}" + extra("head"),
        ]
        for label, attr in rows:
            d, f = getattr(self.ddp, attr), getattr(self.fsdp, attr)
            ratio = f"   (FSDP/DDP {f / d:.2f})" if attr == "state" and d else ""
            lines.append(f"  {label:<16} {format_bytes(d):>11}  {format_bytes(f):>15}" + extra(attr) + ratio)
        lines.append(
            f"  {'in flight':<16} {format_bytes(self.ddp.transient) if self.ddp.transient else '-':>11}  "
            f"{format_bytes(self.fsdp.transient):>15}" + extra("transient") + "   (FSDP: gathered units; DDP bf16: "
            "autocast's weight copies)"
        )
        lines.append(
            f"  {'total':<16} {format_bytes(self.ddp.total):>11}  {format_bytes(self.fsdp.total):>15}" + extra("total")
        )
        mark = lambda meta: "   <- this task" if meta == self.built_on_meta else ""  # noqa: E731
        eager, meta = format_bytes(self.setup_eager), format_bytes(self.setup_meta)
        lines.append(
            f"  {'setup, eager':<16} {eager:>11}  {eager:>15}   (every rank builds the whole model){mark(False)}"
        )
        lines.append(
            f"  {'setup, meta':<16} {eager:>11}  {meta:>15}   (built on the meta device: the shards "
            f"+ the largest block){mark(True)}"
        )
        lines.extend(self._cross_node_lines(extra))
        yes = lambda s: "yes" if self.fits(s) else "no"  # noqa: E731
        lines.append(f"  device           {format_bytes(self.device_memory)} per rank ({self.device})")
        lines.append(
            f"  fits in {FIT_FRACTION:.0%}      DDP {yes('ddp')}, FSDP {yes('fsdp')}"
            + (f", HSDP {yes('hsdp')}" if self.hsdp else "")
            + f" (the other {1 - FIT_FRACTION:.0%} is for activations and the batch)"
        )
        lines.extend(self._activation_lines())
        lines.append(f"  --strategy {strategy:<5} {self.verdict(strategy)}")
        return "\n".join(lines)

    def _hsdp_column(self) -> Callable[[str], str]:
        """The HSDP column's cell for a row ('head', a Footprint attribute, or 'cross'), '' without one."""

        def cell(attr: str) -> str:
            if self.hsdp is None or self.mesh is None:
                return ""
            if attr == "head":
                return f"  {f'HSDP {self.mesh[0]}x{self.mesh[1]}':>13}"
            value = self.cross_node.get("hsdp", 0) if attr == "cross" else getattr(self.hsdp, attr)
            return f"  {format_bytes(value):>13}"

        return cell

    def _cross_node_lines(self, extra: Callable[[str], str]) -> list[str]:
        if self.nnodes < 2 or not self.cross_node:
            return []
        return [
            f"  {'across nodes':<16} {format_bytes(self.cross_node['ddp']):>11}  "
            f"{format_bytes(self.cross_node['fsdp']):>15}" + extra("cross") + f"   (sent per rank per step between "
            f"the {self.nnodes} nodes; HSDP: only its all-reduce of gradient shards)"
        ]

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
            f"  activations      {format_bytes(a.kept)} per rank at --batch-size {a.batch_size}, kept for backward "
            "(DDP and FSDP alike)",
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
    mesh: tuple[int, int] | None = None,
    nnodes: int = 1,
    activations: ActivationEstimate | str | None = None,
    checkpointing: bool = False,
) -> MemoryPlan:
    """Per-rank bytes of the model's state under DDP and FSDP at this world size. `blocks`
    names FSDP's units (ddpkit.fsdp.default_blocks, or the task's hook); None: the root only.
    `mesh`: hsdp's (replicate, shard), planned too; `nnodes`: how many nodes the ranks span
    (the world size split evenly), for the traffic between them. `activations`: measured
    apart (training/probe.py), shown beside the state."""
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    full = sum(p.numel() * p.element_size() for p in params)
    name, per_param, measured = optimizer_state_per_param(optimizer)
    compute_bytes = 2 if precision == "bf16" else 4
    block_list = list(blocks(model)) if blocks else []
    block_sizes = [sum(p.numel() for p in b.parameters()) for b in block_list]
    block_bytes = max((sum(p.numel() * p.element_size() for p in b.parameters()) for b in block_list), default=0)
    largest = max(block_sizes, default=0)
    root = n_params - sum(block_sizes)
    in_flight = (root + min(2, len(block_sizes)) * largest) * compute_bytes + largest * 4
    ddp = Footprint(full, full, int(n_params * per_param), n_params * 2 if precision == "bf16" else 0)

    def sharded(over: int) -> Footprint:
        shard = sum(_shard_numel(p, over) * p.element_size() for p in params)
        return Footprint(shard, shard, int(sum(_shard_numel(p, over) for p in params) * per_param), in_flight)

    hsdp = sharded(mesh[1]) if mesh else None
    setup_shard = sum(_shard_numel(p, world_size) * p.element_size() for p in params)  # the FSDP column
    cross = _cross_node_bytes(params, world_size, compute_bytes, mesh, nnodes) if nnodes > 1 else {}
    return MemoryPlan(
        n_params,
        world_size,
        precision,
        name,
        per_param,
        measured,
        len(block_sizes) + 1,
        largest,
        ddp,
        sharded(world_size),
        device_memory,
        device,
        mesh,
        hsdp,
        nnodes,
        cross,
        setup_eager=full,
        setup_meta=setup_shard + (block_bytes or full - setup_shard),
        built_on_meta=any(p.is_meta for p in params),
        activations=activations,
        checkpointing=checkpointing,
    )


def _cross_node_bytes(
    params: list[torch.Tensor], world: int, compute_bytes: int, mesh: tuple[int, int] | None, nnodes: int
) -> dict[str, int]:
    """What each rank sends per optimizer step in collectives whose group spans nodes (a ring
    sends (n-1)/n of the buffer per gather or reduce-scatter, twice that per all-reduce).
    Gradients are reduced in fp32; FSDP all-gathers the parameters in the compute precision,
    in forward and again in backward. Ranks are numbered node by node."""
    n_params = sum(p.numel() for p in params)
    grads = n_params * 4
    ring = lambda n: (n - 1) / n  # noqa: E731
    fsdp_step = lambda n: ring(n) * (2 * n_params * compute_bytes + grads)  # noqa: E731
    out = {"ddp": int(2 * ring(world) * grads), "fsdp": int(fsdp_step(world))}
    if mesh:
        replicate, shard = mesh
        shard_grads = sum(_shard_numel(p, shard) for p in params) * 4
        across = int(2 * ring(replicate) * shard_grads)
        per_node = world // nnodes
        out["hsdp"] = across if per_node % shard == 0 else across + int(fsdp_step(shard))
    return out


def _shard_numel(p: torch.Tensor, world_size: int) -> int:
    """Elements of the largest dim-0 shard FSDP2 gives a rank (padded to equal rows)."""
    if p.dim() == 0:
        return 1
    return math.ceil(p.shape[0] / world_size) * (p.numel() // p.shape[0] if p.shape[0] else 0)


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
