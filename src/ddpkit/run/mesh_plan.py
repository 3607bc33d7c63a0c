"""The mesh plan of a run with --tp or --pp, as `ddpkit plan` asks for it: the task built as the
plan builds it (on the meta device where it can), measured as one tp rank of each stage holds it
(training/mesh_probe.py), planned on the job's mesh (planning/mesh.py). It plans meshes that
training does not build yet too (FSDP x PP, TP x PP) and says so."""

from __future__ import annotations

from typing import Any

from ..config import RunConfig
from ..errors import DdpkitError
from ..parallel.dims import check_degrees
from ..parallel.spec import StrategyConfig, check, mesh_dims

# what --strategy auto tries under --tp/--pp, fastest first
AUTO_ORDER = ("ddp", "fsdp", "hsdp")


def mesh_plan(
    cfg: RunConfig, tp: int, pp: int, world: int, nnodes: int, local: int, fixed: Any, budget: int | None
) -> Any:
    """The MeshPlan of `cfg`'s task at `world` ranks (`local` per node on `nnodes`), tp x pp of them
    per data-parallel rank; `fixed` a worker's fixed cost (ProcessCost), `budget` the device's
    bytes per rank. `--strategy auto`: the first of AUTO_ORDER that trains today and fits."""
    from ..planning.mesh import plan_mesh
    from ..planning.process import optimizer_state_per_param
    from ..strategies.fsdp import default_blocks
    from ..strategies.pipeline import largest_divisor
    from ..training.mesh_probe import measure_stages
    from .plan import _build_for_plan

    check_degrees(world, tp, pp, local)
    if not isinstance(cfg.batch_size, int):
        raise DdpkitError(
            "ddpkit plan with --tp/--pp needs --batch-size N (samples per process per step): the activations "
            "and the bytes tp and pp send grow with it"
        )
    built, _, _, _ = _build_for_plan(cfg, cfg.seed)
    blocks = built.fsdp_blocks or default_blocks
    v = 2 if cfg.pp_schedule == "interleaved-1f1b" and pp > 1 else 1
    per_param = optimizer_state_per_param(built.optimizer)[1]
    stages = measure_stages(built, tp=tp, n_stages=pp * v, blocks=blocks, per_param=per_param, precision=cfg.precision)
    n_micro = largest_divisor(cfg.batch_size, cfg.pp_microbatches or pp) if pp > 1 else 1
    plans = []
    for name in AUTO_ORDER if cfg.strategy == "auto" else (cfg.strategy,):
        config = StrategyConfig(
            name=name, tp=tp, pp=pp, replicate=cfg.replicate, pp_schedule=cfg.pp_schedule, precision=cfg.precision
        )
        refused = _refusal(config, world, local)
        if name == "hsdp" and nnodes == 1 and cfg.replicate is None:
            continue
        dims = mesh_dims(config, world, nnodes, local)
        plan = plan_mesh(
            stages,
            dims,
            strategy=name,
            micro_batch=cfg.batch_size // n_micro,
            microbatches=n_micro,
            schedule=cfg.pp_schedule,
            accumulate=cfg.accumulate,
            fixed=fixed.of(name != "ddp"),
            nnodes=nnodes,
            budget=budget,
            refused=refused,
        )
        plans.append(plan)
        if cfg.strategy == "auto" and refused is None and plan.fits(0.9):
            return _noted(plan, f"--strategy auto: {name}, the first of {', '.join(AUTO_ORDER)} that trains and fits")
    if cfg.strategy != "auto":
        return plans[0]
    trains = [p for p in plans if p.refused is None] or plans
    best = min(trains, key=lambda p: p.peak)
    return _noted(best, f"--strategy auto: none fits; {best.strategy} holds the least")


def _refusal(config: StrategyConfig, world: int, local: int) -> str | None:
    """What training says of this mesh (None: it trains it)."""
    try:
        check(config, world, local_world_size=local)
    except DdpkitError as e:
        return str(e)
    if config.tp > 1 and config.pp > 1:
        return f"--tp {config.tp} with --pp {config.pp}: tensor x pipeline parallel is not built"
    return None


def _noted(plan: Any, note: str) -> Any:
    import dataclasses

    return dataclasses.replace(plan, notes=(*plan.notes, note))
