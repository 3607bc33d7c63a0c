"""What `ddpkit verify` needs from a real training run: the parameters after every optimizer
step (a trace it can compare step by step between world sizes), and the model in float64.

Comparing only the final model cannot tell a real drift from rounding: Adam turns a float32
rounding difference of 1e-7 into one of the order of the learning rate within an epoch. In
float64 the rounding stays near 1e-15 for the few steps verify runs, so any difference above
that is the task's, and the first step where it appears points at its cause.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..util.tree import map_tensors

TRACE_DIR = "trace"
DROPOUT_FILE = "dropout-off.json"  # the dropout modules a verify run turned off, by name
DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def trace_file(run_dir: Path | str, step: int) -> Path:
    return Path(run_dir) / TRACE_DIR / f"step-{step:06d}.pt"


class ParamTrace:
    """Called after every optimizer step: rank 0 writes the whole model's state (gathered from
    the shards under FSDP, so every rank calls it) as RUN_DIR/trace/step-N.pt, N counting the
    optimizer steps of the run (a resume continues the count)."""

    def __init__(self, run_dir: Path, strategy: Any, model: nn.Module) -> None:
        self.run_dir, self.strategy, self.model = run_dir, strategy, model
        self.step = 0

    def __call__(self) -> None:
        self.step += 1
        state = self.strategy.full_state_dict(self.model)
        if state is not None:
            (self.run_dir / TRACE_DIR).mkdir(parents=True, exist_ok=True)
            torch.save(state, trace_file(self.run_dir, self.step))


def to_float64(model: nn.Module) -> nn.Module:
    """The model in float64, casting every floating input of its forward (positional and
    keyword, nested) on the way in. The parameters stay the same objects, so an optimizer
    the task built over them still holds them."""
    model.double()

    def cast(value: Any) -> Any:
        return map_tensors(value, lambda t: t.double() if t.is_floating_point() else t)

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return cast(args), cast(kwargs)

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def dropout_off(model: nn.Module) -> list[str]:
    """Set p = 0 in every dropout module of `model` (nn.Dropout, its 1d/2d/3d and alpha forms)
    and return their names. Each rank draws its own masks for its share of the batch, so with
    dropout on no two world sizes can agree; with it off verify can judge the rest."""
    off = []
    for name, module in model.named_modules():
        if isinstance(module, DROPOUTS) and module.p > 0:
            module.p = 0.0
            off.append(name)
    return off
