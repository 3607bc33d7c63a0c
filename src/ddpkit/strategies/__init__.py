"""How the model is parallelised: DDP (a whole replica per rank) or FSDP (shards), the
precision, DDP's knobs, and the memory plan that `--strategy auto` asks.

The loop sees a Strategy (base.py) only; make_strategy picks the one --strategy names.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..config import FSDP_NEEDS_TWO, check_no_ddp_only_flags
from ..errors import DdpkitError
from ..runtime import Runtime
from .base import Strategy
from .ddp import DdpStrategy, grad_sync_used, wrap_model
from .memory import detect_device_memory, make_plan
from .precision import check_precision

__all__ = ["DdpStrategy", "Strategy", "check_precision", "choose_strategy", "grad_sync_used",
           "make_strategy", "wrap_model"]


def make_strategy(cfg: Any, rt: Runtime, task: Any) -> Strategy:
    """The strategy --strategy names; `auto` asks the memory plan (DDP when it fits)."""
    name = cfg.strategy
    if name == "auto":
        name = choose_strategy(cfg, rt, task)
    if name == "fsdp":
        if rt.world_size < 2:
            raise DdpkitError(FSDP_NEEDS_TWO)
        check_no_ddp_only_flags(cfg)  # --strategy auto chose FSDP (an explicit fsdp was checked before launch)
        from .fsdp import FsdpStrategy  # FSDP's imports cost ~0.5 s: only for FSDP runs

        return FsdpStrategy(rt, cfg.precision, cfg, blocks=getattr(task, "fsdp_blocks", None))
    return DdpStrategy(rt, cfg.precision, cfg)


def choose_strategy(cfg: Any, rt: Runtime, task: Any) -> str:
    """DDP if model, gradients and optimizer state fit each device, else FSDP (the plan's rule)."""
    from .fsdp import default_blocks

    budget = cfg.device_memory
    name = "given"
    if budget is None:
        budget, name = detect_device_memory(rt.device.type, rt.env.local_world_size)
        if rt.distributed:  # the smallest device decides, the same on every rank
            device = rt.device if rt.backend == "nccl" else torch.device("cpu")
            t = torch.tensor([budget], dtype=torch.int64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            budget = int(t.item())
    plan = make_plan(task.model, task.optimizer, rt.world_size, cfg.precision, budget, name,
                     getattr(task, "fsdp_blocks", None) or default_blocks)
    choice = plan.choose()
    if not cfg.quiet:
        rt.print(f"ddpkit: --strategy auto: {plan.reason()}")
    return choice
