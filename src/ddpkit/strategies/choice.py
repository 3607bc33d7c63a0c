"""`--strategy auto` and the plan's advice: the fastest way to train that fits, everything counted.

The candidates are every registered strategy with a memory model and a distinct layout at this
world (DDP; HSDP when the ranks span nodes; FSDP), each without and with activation
checkpointing, at the asked micro-batch and at smaller ones that divide it, with the
accumulation that keeps the global batch (the same samples per optimizer step: the same
result). They are tried in the order of their expected speed, and the first whose peak
(planning/peak.py: Peak, the fixed cost, the state, what is in flight, the activations and
rank 0's end of run) is within FIT_FRACTION of the device wins:

1. the asked micro-batch before a smaller one (a smaller one does the same work in more,
   smaller steps: a GPU runs them less efficiently);
2. no recomputation before activation checkpointing (which runs every block's forward twice,
   about a third more compute);
3. a whole replica (DDP) before HSDP before FSDP (each shards more and sends more).

The order is a stated assumption, not a measurement: a run that is faster otherwise can name
its strategy. Without an activation estimate (no batch size) only the strategies are compared.
When nothing fits, the line says to expect out-of-memory and names the least: the candidate
whose own part of the peak (all but the fixed cost) is smallest, the smallest peak among equals.
The fixed cost (torch, the modules, the data) is what no setting and no added process removes;
compared whole, FSDP's few MiB of imports (measured, noisy) could name DDP the least on a model
whose state FSDP quarters, and more processes, the advice, would not help DDP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config.values import format_bytes
from ..errors import DdpkitError
from ..parallel.spec import StrategyConfig, check, strategy_spec, strategy_specs

FIT_FRACTION = 0.9  # of the device: the rest is a margin for what the plan does not count
MemoryPlan = Any  # planning/memory.py's, which imports this module (its plan's choice())


@dataclass(frozen=True)
class Choice:
    strategy: str
    checkpointing: bool
    batch_size: int | None  # the micro-batch (None: the plan was given none)
    accumulate: int | None  # micro-batches per step that keep the global batch (None: as --global-batch-size says)
    peak: Any  # planning/peak.py: Peak
    fits: bool
    line: str  # why, in one line

    def settings(self) -> dict[str, object]:
        """The run's settings this choice sets."""
        out: dict[str, object] = {"strategy": self.strategy, "activation_checkpointing": self.checkpointing}
        if self.batch_size is not None:
            out["batch_size"] = self.batch_size
        if self.accumulate is not None:
            out["accumulate"] = self.accumulate
        return out


def strategies(plan: MemoryPlan, config: StrategyConfig | None = None) -> list[str]:
    """The registered strategies auto may pick at this world, fastest first: each layout once,
    only those `config`'s other settings allow (FSDP refuses DDP's knobs)."""
    seen, out = set(), []
    for spec in strategy_specs():
        if spec.memory is None or spec.build is None or (spec.shards and plan.world_size < 2):
            continue
        candidate = StrategyConfig(name=spec.name) if config is None else _as(config, spec.name)
        try:
            check(candidate, plan.world_size)
        except DdpkitError:
            continue
        mesh = spec.mesh(candidate, plan.world_size, plan.nnodes) if spec.shards else (plan.world_size, 1)
        if (spec.shards, mesh) not in seen:
            seen.add((spec.shards, mesh))
            out.append((spec.shards, -mesh[0], spec.name))
    return [name for *_, name in sorted(out)]


def _as(config: StrategyConfig, name: str) -> StrategyConfig:
    import dataclasses

    return dataclasses.replace(config, name=name, replicate=None)


def micro_batches(batch_size: int) -> list[int]:
    """The micro-batches that divide `batch_size`, largest first."""
    return [b for b in range(batch_size, 0, -1) if batch_size % b == 0]


def choose(
    plan: MemoryPlan,
    batch_size: int | None = None,
    accumulate: int = 1,
    *,
    fixed_global: bool = False,
    checkpointing: bool = False,
    config: StrategyConfig | None = None,
) -> Choice:
    """The fastest candidate that fits `plan`'s device (the order: this module's docstring).
    `checkpointing`: asked for (kept on). `fixed_global`: --global-batch-size sets the accumulation."""
    a = plan.activations if hasattr(plan.activations, "at") else None  # an ActivationEstimate, not a reason
    batch = batch_size if a is not None and batch_size else None
    can_ckpt = a is not None and a.kept_checkpointed is not None
    tried: list[Choice] = []
    for micro in micro_batches(batch) if batch else [None]:
        for ckpt in (True,) if checkpointing else ((False, True) if can_ckpt else (False,)):
            for name in strategies(plan, config):
                peak = plan.peak(name, ckpt, micro)
                acc = None if micro is None or fixed_global else accumulate * (batch // micro)  # type: ignore[operator]
                c = Choice(name, ckpt, micro, acc, peak, peak.total <= FIT_FRACTION * plan.device_memory, "")
                if c.fits:
                    return _said(c, tried[0] if tried else None, plan, batch)
                tried.append(c)
    least = min(tried, key=lambda c: (c.peak.total - c.peak.fixed, c.peak.total))
    return _said(least, None, plan, batch)


def describe(c: Choice, plan: MemoryPlan, asked_batch: int | None = None) -> str:
    """'FSDP x4 + activation checkpointing at --batch-size 8 --accumulate 2'."""
    spec = strategy_spec(c.strategy)
    _, mesh = plan.footprint(c.strategy)
    text = spec.column(mesh)
    if c.checkpointing:
        text += " + activation checkpointing"
    if c.batch_size is not None and c.batch_size != asked_batch:
        text += f" at --batch-size {c.batch_size}" + (f" --accumulate {c.accumulate}" if c.accumulate else "")
    return text


def _said(c: Choice, first: Choice | None, plan: MemoryPlan, asked: int | None) -> Choice:
    import dataclasses

    budget = (
        f"{format_bytes(FIT_FRACTION * plan.device_memory)} ({FIT_FRACTION:.0%} of {format_bytes(plan.device_memory)})"
    )
    need = format_bytes(c.peak.total)
    if not c.fits:
        line = (
            f"{c.strategy}: nothing fits; the least, {describe(c, plan, asked)}, needs {need} per rank, more than "
            f"{budget}: expect out-of-memory; use more processes or nodes, or a device with more memory"
        )
    elif first is None:
        line = f"{c.strategy}: {describe(c, plan, asked)} needs {need} per rank, within {budget}; the fastest"
    else:
        line = (
            f"{c.strategy}: {describe(first, plan, asked)} needs {format_bytes(first.peak.total)} per rank, more "
            f"than {budget}; {describe(c, plan, asked)} needs {need}"
        )
    return dataclasses.replace(c, line=line)
