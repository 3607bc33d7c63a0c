"""Wrap a model for the run: one process (as is) or DDP."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .runtime import Runtime


def wrap_model(model: nn.Module, rt: Runtime, **ddp_options: Any) -> nn.Module:
    """Move the model to this rank's device and wrap it in DDP when there are several ranks.
    DDP broadcasts rank 0's parameters, so every replica starts identical."""
    model = model.to(rt.device)
    if not rt.env.distributed:
        return model
    options: dict[str, Any] = {"gradient_as_bucket_view": True}
    options.update(ddp_options)
    if rt.device.type == "cuda":
        options.setdefault("device_ids", [rt.device.index])
    return DDP(model, **options)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside any wrapper (state_dict keys without `module.`)."""
    while isinstance(model, DDP) or hasattr(model, "_orig_mod"):
        model = model.module if isinstance(model, DDP) else model._orig_mod  # type: ignore[assignment]
    return model


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unwrapped model's weights, detached copies on the CPU."""
    return {k: v.detach().to("cpu", copy=True) for k, v in unwrap(model).state_dict().items()}
