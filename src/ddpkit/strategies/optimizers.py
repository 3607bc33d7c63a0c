"""Building the task's optimizer over the parameters a strategy steps, and rebuilding one.

A strategy that replaces the parameters (FSDP shards them) or the kernel (fused Adam) must
build a new optimizer of the same class with the same settings. `opt.defaults` cannot be
passed back as it is: torch 2.13's AdamW lists `decoupled_weight_decay`, which its
constructor does not take. Only the constructor's own keywords are passed.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..errors import DdpkitError

# what a task gives: an optimizer, or a function of the parameters that builds one
OptimizerSpec = torch.optim.Optimizer | Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]


def make_optimizer(spec: OptimizerSpec, model: nn.Module, lr: float | None) -> torch.optim.Optimizer:
    """The task's optimizer (an instance, or a function of the parameters) over `model`'s
    parameters, with --lr applied when given."""
    opt = spec
    if not isinstance(opt, torch.optim.Optimizer):
        opt = opt(model.parameters())
        if not isinstance(opt, torch.optim.Optimizer):
            raise DdpkitError("the task's optimizer function must return a torch.optim.Optimizer")
    else:
        own = {id(p) for p in model.parameters()}
        if not any(id(p) in own for g in opt.param_groups for p in g["params"]):
            raise DdpkitError("the task's optimizer does not optimise the task's model parameters")
    if lr is not None:
        for group in opt.param_groups:
            group["lr"] = lr
    return opt


def constructor_keywords(cls: type) -> set[str] | None:
    """The keyword arguments `cls.__init__` takes (None: it takes any)."""
    params = inspect.signature(cls.__init__).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {
        p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }


def rebuild_optimizer(
    opt: torch.optim.Optimizer, swap: Callable[[torch.Tensor], torch.Tensor] = lambda p: p, **overrides: Any
) -> torch.optim.Optimizer:
    """A fresh optimizer of `opt`'s class: the same param groups (each parameter replaced by
    `swap(p)`) and settings, with `overrides` applied to every group. Its state starts empty."""
    cls = type(opt)
    accepted = constructor_keywords(cls)
    defaults = {
        k: v for k, v in {**opt.defaults, **overrides}.items() if k != "params" and (accepted is None or k in accepted)
    }
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, **overrides, "params": [swap(p) for p in g["params"]]}
        for g in opt.param_groups
    ]
    try:
        return cls(groups, **defaults)
    except Exception as e:
        raise DdpkitError(
            f"could not rebuild the task's {cls.__name__} ({e}); give the optimizer as a function of the "
            "parameters: optimizer=lambda params: ..."
        ) from None
