"""The memory plan: what each rank holds under each strategy before a run, which fits, and
the table `ddpkit plan` prints.

The guide's rule: if model, optimizer and batch fit on one device, use DDP (fastest); if
not, FSDP, which shards parameters, gradients and optimizer state over the N ranks at the
price of more communication. The plan measures the model once (parallel/footprints.py: ModelSizes)
and asks each registered strategy's memory model (parallel/spec.py: StrategySpec.memory) over
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

The optimizer's state per parameter element and a worker's fixed cost are measured
(process.py). Activations and the batch are not in the total: a strategy "fits" when the
plan's total is at most FIT_FRACTION of the device's memory, leaving the rest for them.

HSDP over a (replicate R, shard S) mesh holds FSDP's state sharded over S instead of N. On
several nodes the plan also counts what each rank sends per optimizer step in collectives
whose group spans nodes (ring estimates): DDP's all-reduce of every gradient, FSDP's
all-gathers (forward and backward) and reduce-scatter over all ranks, and HSDP's all-reduce
of the 1/S gradient shards between replicas (its gathers and reduce-scatters stay inside a
node when each node holds whole shard groups).

The activations are shown beside the state when ddpkit plan (or --dry-run) could measure
them (peak.py: ActivationEstimate), with and without --activation-checkpointing, and the plan
warns when they need more than the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from torch import nn

from ..config.values import format_bytes
from ..parallel.footprints import Footprint, ModelSizes, cross_node_bytes
from ..parallel.spec import StrategyConfig, StrategySpec, strategy_spec, strategy_specs
from ..strategies.choice import FIT_FRACTION, Choice, choose
from .peak import ActivationEstimate, Peak
from .process import ProcessCost, optimizer_state_per_param


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
    process: ProcessCost = ProcessCost()
    sizes: ModelSizes | None = None  # what any strategy's memory model needs (the auto search asks more)
    built_how: str = ""  # how the plan built the model (the meta device, or eagerly and why)
    accumulate: int = 1  # the run's --accumulate, and whether --global-batch-size sets it instead
    fixed_global: bool = False

    def footprint(self, strategy: str) -> tuple[Footprint, tuple[int, int]]:
        """`strategy`'s footprint and layout at this plan's world size (planned or not)."""
        if strategy in self.footprints:
            return self.footprints[strategy], self.meshes[strategy]
        spec = strategy_spec(strategy)
        mesh = spec.mesh(StrategyConfig(name=strategy), self.world_size, self.nnodes)
        assert self.sizes is not None and spec.memory is not None
        return spec.memory(self.sizes, mesh), mesh

    def peak(self, strategy: str, checkpointing: bool | None = None, batch_size: int | None = None) -> Peak:
        """One rank's peak under `strategy`, with or without activation checkpointing (default:
        the plan's), at a micro-batch of `batch_size` (default: the plan's); rank 0's end of run
        included (the whole model gathered beside a sharded strategy's shards; DDP saves the
        weights it holds)."""
        f, _ = self.footprint(strategy)
        sharded = strategy_spec(strategy).shards
        a = self.activations
        act = None
        if isinstance(a, ActivationEstimate):
            ckpt = self.checkpointing if checkpointing is None else checkpointing
            act = a.of(sharded).at(batch_size or a.batch_size).need(ckpt)
        # FSDP frees its gradient shards after each step (set to None) and makes them again during
        # backward, as the activations are freed: its peak holds the larger of the two (measured: the
        # start of backward for a model whose activations outweigh its gradients, the end otherwise);
        # DDP's gradients stay in its buckets. At the end rank 0 writes model.pt: DDP the weights it
        # holds, FSDP one gathered tensor at a time
        state = f.params + f.optimizer if sharded else f.state
        end = state + (self.largest_tensor if sharded else 0)
        return Peak(self.process.of(sharded), state, f.transient, act, end, f.grads if sharded else 0)

    @property
    def largest_tensor(self) -> int:
        """Bytes of the model's largest parameter, whole."""
        shapes = self.sizes.shapes if self.sizes is not None else ()
        return max((math.prod(shape) * size for shape, size in shapes), default=0)

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
        return self.peak(strategy).total <= FIT_FRACTION * self.device_memory

    def choice(self, batch_size: int | None = None, accumulate: int | None = None, **options: Any) -> Choice:
        """The fastest way that fits (strategies/choice.py: Choice): strategy, activation
        checkpointing and micro-batch; `batch_size` default: the activations' own."""
        a = self.activations
        if batch_size is None and isinstance(a, ActivationEstimate):
            batch_size = a.batch_size
        options.setdefault("fixed_global", self.fixed_global)
        return choose(self, batch_size, accumulate or self.accumulate, checkpointing=self.checkpointing, **options)

    def as_dict(self) -> dict[str, Any]:
        """The plan's figures (bytes per rank) and auto's choice, for `ddpkit plan --json`."""
        a = self.activations
        choice = self.choice()
        strategies = {}
        for name in self.footprints:
            p = self.peak(name)
            strategies[name] = {
                "state": p.state,
                "in_flight": p.transient,
                "fixed": p.fixed,
                "activations": p.activations,
                "grads_made_in_backward": p.grads_made,
                "end_of_run": p.fixed + p.end_of_run,
                "peak": p.total,
                "fits": self.fits(name),
            }
        return {
            "parameters": self.n_params,
            "world_size": self.world_size,
            "precision": self.precision,
            "device_memory": self.device_memory,
            "fit_fraction": FIT_FRACTION,
            "activations_batch_size": a.batch_size if isinstance(a, ActivationEstimate) else None,
            "checkpointing": self.checkpointing,
            "strategies": strategies,
            "auto": {**choice.settings(), "peak": choice.peak.total, "fits": choice.fits, "why": choice.line},
        }

    def choose(self) -> str:
        """The strategy `--strategy auto` picks (with what else it changes: choice())."""
        return self.choice().strategy

    def reason(self) -> str:
        return self.choice().line

    def verdict(self, strategy: str) -> str:
        """The last line of the plan: what `strategy` would do here."""
        spec = strategy_spec(strategy)
        if spec.memory is None:
            return self.reason()
        if spec.shards and self.world_size < 2:
            return f"{strategy.upper()} needs 2 or more processes (--nproc 2+)"
        need = format_bytes(self.peak(strategy).total)
        if self.fits(strategy):
            return f"{strategy.upper()} needs {need} per rank: fits"
        return f"{strategy.upper()} needs {need} per rank: does not fit; --strategy auto would pick {self.reason()}"

    def _columns(self) -> list[tuple[StrategySpec, Footprint, int]]:
        """(strategy, footprint, width) of each column: the first two as wide as DDP's and FSDP's."""
        specs = [s for s in strategy_specs() if s.name in self.footprints]
        return [(s, self.footprints[s.name], (11, 15)[i] if i < 2 else 13) for i, s in enumerate(specs)]

    def format(self, title: str, strategy: str = "auto") -> str:
        """The plan as `ddpkit plan` prints it: the model, a column per strategy of what a rank
        holds, what building the model holds, and whether each strategy fits."""
        n = self.world_size
        opt = f"{self.optimizer}, {self.optimizer_bytes_per_param:g} bytes of state per parameter" + (
            "" if self.optimizer_measured else " (assumed: it could not be probed)"
        )
        cols = self._columns()
        row = lambda cells: "  ".join(f"{c:>{w}}" for c, (_, _, w) in zip(cells, cols, strict=True))  # noqa: E731
        lines = [
            f"memory plan: {title}, {n} process{'es' if n != 1 else ''}, {self.precision}",
            f"  model            {self.n_params:,} parameters, "
            f"{self.units} FSDP units (largest block {self.largest_block:,}){self.built_how}",
            f"  optimizer        {opt}",
            "  per rank         " + row([s.column(self.meshes[s.name]) for s, _, _ in cols]),
            *self._state_rows(row, cols),
            *self._setup_rows(row, cols),
            *self._fit_rows(cols),
            f"  --strategy {strategy:<5} {self.verdict(strategy)}",
        ]
        return "\n".join(lines)

    def _state_rows(
        self, row: Callable[[list[str]], str], cols: list[tuple[StrategySpec, Footprint, int]]
    ) -> list[str]:
        """What a rank holds in training, a row per part of its peak, and the peak."""
        value = lambda attr: [format_bytes(getattr(f, attr)) for _, f, _ in cols]  # noqa: E731
        peaks = [self.peak(s.name) for s, _, _ in cols]
        of_peak = lambda attr: [format_bytes(getattr(p, attr)) for p in peaks]  # noqa: E731
        first, second = cols[0][0].title, cols[1][0].title
        lines = []
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
        lines.append(f"  {'fixed cost':<16} " + row(of_peak("fixed")) + f"   ({self.process.source})")
        lines.extend(self._activation_rows(row, peaks))
        lines.append(
            f"  {'end of run':<16} "
            + row([format_bytes(p.fixed + p.end_of_run) for p in peaks])
            + "   (rank 0 writing model.pt: its state; FSDP + one gathered tensor at a time)"
        )
        lines.append(f"  {'peak':<16} " + row(of_peak("total")))
        return lines

    def _setup_rows(
        self, row: Callable[[list[str]], str], cols: list[tuple[StrategySpec, Footprint, int]]
    ) -> list[str]:
        """What building the model holds, eagerly and on the meta device (which this task does
        marked), and on several nodes what a rank sends between them per step."""
        mark = lambda meta: "   <- this task" if meta == self.built_on_meta else ""  # noqa: E731
        eager, meta = format_bytes(self.setup_eager), format_bytes(self.setup_meta)
        lines = [
            f"  {'setup, eager':<16} {eager:>11}  {eager:>15}   (every rank builds the whole model){mark(False)}",
            f"  {'setup, meta':<16} {eager:>11}  {meta:>15}   (built on the meta device: the shards "
            f"+ the largest block){mark(True)}",
        ]
        if self.nnodes > 1 and self.cross_node:
            lines.append(
                f"  {'across nodes':<16} "
                + row([format_bytes(self.cross_node[s.name]) for s, _, _ in cols])
                + f"   (sent per rank per step between the {self.nnodes} nodes; HSDP: only its all-reduce of "
                "gradient shards)"
            )
        return lines

    def _fit_rows(self, cols: list[tuple[StrategySpec, Footprint, int]]) -> list[str]:
        """The device's memory per rank and which strategy's peak fits in FIT_FRACTION of it."""
        fits = ", ".join(f"{s.title} {'yes' if self.fits(s.name) else 'no'}" for s, _, _ in cols)
        lines = [
            f"  device           {format_bytes(self.device_memory)} per rank ({self.device})",
            f"  fits in {FIT_FRACTION:.0%}      {fits} (the peak, within {FIT_FRACTION:.0%}: the rest is a margin "
            "for what is not counted, the batch itself and fragmentation)",
        ]
        if not self.process.release:
            lines.append(
                "  allocator        glibc keeps what the workers free (not counted: expect a peak up to 1.5x the "
                "plan's); --cpu-allocator release, or a run sized with --device-memory, returns it"
            )
        return lines

    def _activation_rows(self, row: Callable[[list[str]], str], peaks: list[Peak]) -> list[str]:
        """The activations' row (the same in every column) and how it was measured, or why not."""
        a = self.activations
        if a is None:
            return ["  activations      not counted: give the plan --batch-size to measure them"]
        if isinstance(a, str):
            return [f"  activations      not estimated: {a}"]
        how = f"at --batch-size {a.batch_size}"
        if a.precision != "fp32":
            how += f" in {a.precision} " + (
                "(the model cast: autocast's copies not counted)" if a.on_meta else "(autocast)"
            )
        if a.on_meta:
            how += " on the meta device"
        cells = [format_bytes(p.activations or 0) for p in peaks]
        with_ckpt = (
            f"{format_bytes(a.kept_checkpointed)} + {format_bytes(a.recomputed)} while a block is recomputed"
            if a.kept_checkpointed is not None
            else "no blocks to checkpoint"
        )
        on = "on" if self.checkpointing else "off"
        return [
            f"  {'activations':<16} " + row(cells) + f"   ({how}, kept for backward; checkpointing {on})",
            f"  checkpointed     {with_ckpt} (--activation-checkpointing)",
        ]


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
    process: ProcessCost | None = None,
    built_how: str = "",
    built_on_meta: bool | None = None,
    accumulate: int = 1,
    fixed_global: bool = False,
) -> MemoryPlan:
    """Per-rank bytes of the model's state at this world size under every registered strategy
    that is `planned` (DDP, FSDP) and under `strategy` (e.g. hsdp with `replicate` replicas),
    each by its memory model over its layout. `blocks` names FSDP's units
    (ddpkit.fsdp.default_blocks, or the task's hook); None: the root only. `nnodes`: how many
    nodes the ranks span (the world size split evenly), for the traffic between them.
    `activations`: measured apart (training/probe.py), shown beside the state."""
    name, per_param, measured = optimizer_state_per_param(optimizer)
    sizes, block_bytes = model_sizes(model, per_param, precision, blocks)
    specs = [s for s in strategy_specs() if s.memory is not None and (s.planned or s.name == strategy)]
    config = lambda s: StrategyConfig(name=s.name, replicate=replicate if s.name == strategy else None)  # noqa: E731
    meshes = {s.name: s.mesh(config(s), world_size, nnodes) for s in specs}
    full, setup_shard = sizes.nbytes(), sizes.nbytes(world_size)  # setup: the FSDP column's shards
    return MemoryPlan(
        sizes.numel(),
        world_size,
        precision,
        name,
        per_param,
        measured,
        sizes.blocks + 1,
        sizes.largest_block,
        {s.name: s.memory(sizes, meshes[s.name]) for s in specs},  # type: ignore[misc]
        meshes,
        device_memory,
        device,
        asked=strategy,
        nnodes=nnodes,
        cross_node={s.name: cross_node_bytes(sizes, meshes[s.name], nnodes) for s in specs} if nnodes > 1 else {},
        setup_eager=full,
        setup_meta=setup_shard + (block_bytes or full - setup_shard),
        built_on_meta=any(p.is_meta for p in model.parameters()) if built_on_meta is None else built_on_meta,
        activations=activations,
        checkpointing=checkpointing,
        process=process or ProcessCost(),
        sizes=sizes,
        built_how=built_how,
        accumulate=accumulate,
        fixed_global=fixed_global,
    )


def model_sizes(
    model: nn.Module, per_param: float, precision: str, blocks: Callable[[nn.Module], Iterable[nn.Module]] | None
) -> tuple[ModelSizes, int]:
    """The model as the memory models see it (each parameter's shape, FSDP's units), and the
    bytes of its largest block (what a build on the meta device holds full-size for a moment)."""
    params = list(model.parameters())
    block_list = list(blocks(model)) if blocks else []
    block_sizes = [sum(p.numel() for p in b.parameters()) for b in block_list]
    block_bytes = max((sum(p.numel() * p.element_size() for p in b.parameters()) for b in block_list), default=0)
    sizes = ModelSizes(
        tuple((tuple(p.shape), p.element_size()) for p in params),
        per_param,
        precision,
        root=sum(p.numel() for p in params) - sum(block_sizes),
        largest_block=max(block_sizes, default=0),
        blocks=len(block_sizes),
    )
    return sizes, block_bytes
