"""How the model is parallelised: DDP (a whole replica per rank) or FSDP (shards over a
device mesh; HSDP is FSDP over a 2-D one), the precision, DDP's knobs, and the memory plan
that `--strategy auto` asks (choice.py; resolved in the workers by training/auto.py).

The loop sees a Strategy (base.py) only; make_strategy builds the one --strategy names, by
the factory its registry entry names (build_ddp, build_fsdp here). The registry, the
settings a strategy reads and the rules it refuses by are in ddpkit/strategy_config.py,
below config/, so that the config, the launcher and the own-loop Session check alike.
"""

from __future__ import annotations

from typing import Any

from ..config import RunConfig
from ..errors import DdpkitError
from ..parallel.spec import StrategyConfig, check, dp_layout, strategy_spec
from ..runtime import Runtime
from ..task import Task
from .base import Strategy
from .ddp import DdpStrategy, grad_sync_used, wrap_model
from .materialize import ModelInit
from .precision import check_precision

__all__ = [
    "DdpStrategy",
    "Strategy",
    "StrategyConfig",
    "build_ddp",
    "build_fsdp",
    "check",
    "check_precision",
    "grad_sync_used",
    "make_strategy",
    "strategy_for",
    "wrap_model",
]


def make_strategy(cfg: RunConfig, rt: Runtime, task: Task) -> Strategy:
    """The strategy --strategy names (`auto` is resolved before, in the workers:
    training/auto.py). Checked again here: the real world size, and what auto chose (an
    explicit one was checked before launch)."""
    config = cfg.strategy_config()
    check(config, rt.world_size, local_world_size=rt.env.local_world_size)
    _not_built_yet(config)
    if config.pp > 1:
        from .pipeline import pipeline_for  # torch.distributed.pipelining: only for --pp runs

        strategy: Strategy = pipeline_for(config, rt, task)
    else:
        strategy = strategy_for(config, rt, blocks=task.fsdp_blocks, checkpoint_blocks=task.checkpoint_blocks)
        strategy.tp_plan = task.tp_plan
    init_from = cfg.init_from or task.init_from
    strategy.init = ModelInit(task.init_weights, str(init_from) if init_from else None, cfg.seed)
    note = strategy_spec(config.name).note
    said = note(strategy.mesh_shape) if note is not None else None
    if said and not cfg.quiet:
        rt.print(f"ddpkit: {said}")
    choice = strategy.compile_choice
    if choice is not None and not cfg.quiet:
        rt.print(f"ddpkit: --compile with the {choice.backend} backend: {choice.why}")
    return strategy


def _not_built_yet(config: StrategyConfig) -> None:
    """The mesh's dims whose strategy this build lacks: refused, never silently trained without."""
    if config.pp > 1 and config.tp > 1:
        raise DdpkitError(
            f"--pp {config.pp} with --tp {config.tp}: this ddpkit cannot compose pipeline and tensor parallel yet; "
            "drop one of them"
        )


def strategy_for(config: StrategyConfig, rt: Runtime, *, blocks: Any = None, checkpoint_blocks: Any = None) -> Strategy:
    """The Strategy the registered `config.name` builds over `rt` (its StrategySpec's factory,
    over its layout: FSDP over a (replicate, shard) mesh, R > 1 with --replicate R or by hsdp's
    default, one replica per node: strategy_config.fsdp_mesh, hsdp_mesh).
    Activation checkpointing recomputes `checkpoint_blocks(model)`, else the blocks FSDP would shard."""
    spec = strategy_spec(config.name)
    # the layout is the data-parallel ranks' (tp splits within each)
    mesh = dp_layout(config, rt.world_size, rt.env.nnodes, rt.env.local_world_size) if spec.layout else None
    return spec.factory()(rt, config, blocks=blocks, checkpoint_blocks=checkpoint_blocks or blocks, mesh_shape=mesh)


def build_ddp(
    rt: Runtime, config: StrategyConfig, *, blocks: Any, checkpoint_blocks: Any, mesh_shape: tuple[int, int] | None
) -> Strategy:
    """The ddp entry's factory: a whole replica per rank (no mesh, no blocks to shard)."""
    return DdpStrategy(rt, config, checkpoint_blocks=checkpoint_blocks)


def build_fsdp(
    rt: Runtime, config: StrategyConfig, *, blocks: Any, checkpoint_blocks: Any, mesh_shape: tuple[int, int] | None
) -> Strategy:
    """The fsdp and hsdp entries' factory: FSDP over every rank, or over `mesh_shape`."""
    from .fsdp import FsdpStrategy  # FSDP's imports cost ~0.5 s: only for FSDP runs

    return FsdpStrategy(rt, config, blocks=blocks, mesh_shape=mesh_shape, checkpoint_blocks=checkpoint_blocks)
