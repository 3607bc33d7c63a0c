"""`--strategy auto` in the workers: measured once, chosen once, the same on every rank.

Before the batches are planned, every worker measures its fixed cost (planning/process.py:
measure_process) and its device's memory; the largest cost and the smallest device decide.
Rank 0 then probes the activations of one micro-batch (training/probe.py, at the run's
precision), makes the memory plan and picks the fastest candidate that fits
(strategies/choice.py: the strategy, activation checkpointing, and a smaller micro-batch with
the accumulation that keeps the global batch); every rank takes its choice, so they cannot
disagree. The probe leaves the model and the random streams as they were: a run by auto
trains the same model as one that names the chosen settings.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import RunConfig
from ..planning.memory import make_plan
from ..planning.process import ProcessCost, device_budget
from ..runtime.group import Runtime
from ..task import Task
from .probe import estimate_activations


def resolve_auto(cfg: RunConfig, rt: Runtime, task: Task, process: ProcessCost) -> tuple[RunConfig, str | None]:
    """`cfg` with auto's strategy, checkpointing, micro-batch and accumulation (unchanged unless
    --strategy auto), and why, in one line (None: not auto); rank 0 prints it."""
    if cfg.strategy != "auto":
        return cfg, None
    from ..strategies.fsdp import default_blocks  # what a sharded worker imports: its cost is measured

    budget, where = device_budget(cfg.device_memory, rt.device.type, rt.env.local_world_size)
    mine = (budget, process.fixed, process.sharded_imports)
    everyone = rt.all_gather_object(mine) if rt.distributed else [mine]
    budget = min(e[0] for e in everyone)  # the smallest device and the largest cost decide
    process = ProcessCost(max(e[1] for e in everyone), max(e[2] for e in everyone), process.source, process.release)
    chosen: Any = None
    if rt.is_main:
        blocks = task.fsdp_blocks or default_blocks
        with _untouched(task.model):
            activations = estimate_activations(task, cfg.batch_size, task.checkpoint_blocks or blocks, cfg.precision)
        plan = make_plan(
            task.model,
            task.optimizer,
            rt.world_size,
            cfg.precision,
            budget,
            where,
            blocks,
            nnodes=rt.env.nnodes,
            activations=activations,
            checkpointing=cfg.activation_checkpointing,
            process=process,
        )
        choice = plan.choice(
            cfg.batch_size,
            cfg.accumulate,
            fixed_global=cfg.global_batch_size is not None,
            config=cfg.strategy_config(),
        )
        chosen = (choice.settings(), choice.line)
    settings, line = rt.broadcast_object(chosen) if rt.distributed else chosen
    if not cfg.quiet:
        rt.print(f"ddpkit: --strategy auto: {line}")
    return cfg.replace(**settings), f"--strategy auto: {line}"


class _untouched:
    """The probe's forward leaves no trace: the random streams and the buffers (a BatchNorm's
    running statistics) are as they were before it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __enter__(self) -> None:
        import random

        import numpy as np

        self.rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
        self.buffers = [(b, b.detach().clone()) for b in self.model.buffers() if not b.is_meta]

    def __exit__(self, *exc: object) -> None:
        import random

        import numpy as np

        torch.set_rng_state(self.rng[0])
        random.setstate(self.rng[1])
        np.random.set_state(self.rng[2])
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
