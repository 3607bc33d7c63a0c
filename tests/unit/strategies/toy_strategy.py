"""A strategy in one file, as a plugin would add one: a DDP variant whose rule refuses any
precision but fp32 and whose memory model counts the optimizer state split over the replicas
(as ZeRO-1 would). It builds plain DDP under its own name, so its runs say "toy"; only the plan
shows the split. It imports no torch, as the registry does not: registered before the CLI is
built, its help line is in `ddpkit train --help`. test_strategy_registry.py registers it and takes it back."""

from __future__ import annotations

from typing import Any

from ddpkit.errors import DdpkitError
from ddpkit.parallel.footprints import Footprint, ModelSizes
from ddpkit.parallel.spec import StrategyConfig, StrategySpec

REFUSAL = "--strategy toy computes in fp32 only; drop --precision"


def build(rt: Any, config: StrategyConfig, *, blocks: Any, checkpoint_blocks: Any, mesh_shape: Any) -> Any:
    from ddpkit.strategies import DdpStrategy  # torch and the config: only once a run builds it

    class ToyStrategy(DdpStrategy):
        name = "toy"

    return ToyStrategy(rt, config, checkpoint_blocks=checkpoint_blocks)


def fp32_only(config: StrategyConfig, world_size: int | None, own_loop: bool) -> None:
    if config.precision != "fp32":
        raise DdpkitError(f"{REFUSAL} {config.precision}")


def optimizer_split(sizes: ModelSizes, mesh: tuple[int, int]) -> Footprint:
    full, replicas = sizes.nbytes(), mesh[0]
    return Footprint(full, full, int(sizes.numel() * sizes.optimizer_bytes / replicas), 0)


TOY = StrategySpec(
    "toy",
    "a DDP variant that plans its optimizer state split over the replicas (a test's plugin)",
    build=f"{__name__}:build",
    memory=optimizer_split,
    rules=(fp32_only,),
)
