"""FSDP's optimizer step on the local shards: the same arithmetic, without DTensor's dispatch.

Why: FSDP2's parameters, gradients and optimizer state are DTensors. Every op the optimizer
runs on them (AdamW's foreach path: ~12 ops per param group and step) goes through DTensor's
Python dispatch (sharding propagation, wrapping) before the same op runs on the local
shards. Profiled on the GPT example (2 CPU ranks), that made FSDP's optimizer step 4-5x
DDP's, on half the elements. An optimizer's update is elementwise per parameter, so running
it on each DTensor's local tensor computes the same numbers, bit for bit. Only torch's own
elementwise optimizers (ELEMENTWISE) are stepped so: one that looks across a parameter's
elements (LBFGS, Adafactor's row and column statistics, an orthogonalising Muon) would see
only a shard, so any other optimizer keeps DTensor's step.

How: while `step` runs, each param group holds the local tensors (their `.grad` the local
gradients, their state the local state); after it, everything is put back, so the
optimizer's state_dict, sharded checkpoints and anything else between steps see the
DTensors as before. State the first step creates (plain tensors of a shard's shape) is
wrapped back into DTensors laid out as their parameter.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
from torch.distributed.tensor import DTensor

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam")


def step_on_local_shards(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make `optimizer.step` run on the local shards of its DTensor parameters (see above);
    any other optimizer, one over plain tensors, or a fused one (one op already) is left as it is."""
    cls = type(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if (
        cls.__module__.split(".")[:2] != ["torch", "optim"]
        or cls.__name__ not in ELEMENTWISE
        or not any(isinstance(p, DTensor) for p in params)
        or optimizer.defaults.get("fused")
    ):
        return optimizer
    step = optimizer.step

    @functools.wraps(step.__func__)
    def local_step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        swapped = _to_local(self)
        try:
            return step(*args, **kwargs)
        finally:
            _back(self, swapped)

    local_step.on_local_shards = True  # type: ignore[attr-defined]  (what tests and readers can ask)
    # a bound method, as torch's LR schedulers expect when they wrap optimizer.step in turn
    optimizer.step = types.MethodType(local_step, optimizer)  # type: ignore[method-assign]
    return optimizer


Swapped = list[tuple[DTensor, torch.Tensor, dict[str, Any]]]  # (parameter, its local tensor, its state)


def _to_local(optimizer: torch.optim.Optimizer) -> Swapped:
    swapped: Swapped = []
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            if not isinstance(p, DTensor):
                continue
            local = p._local_tensor.detach().requires_grad_(p.requires_grad)
            if p.grad is not None:
                local.grad = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
            state = optimizer.state.pop(p) if p in optimizer.state else {}
            if state:
                optimizer.state[local] = {k: _local(v) for k, v in state.items()}
            params[i] = local
            swapped.append((p, local, state))
    return swapped


def _back(optimizer: torch.optim.Optimizer, swapped: Swapped) -> None:
    by_local = {id(local): p for p, local, _ in swapped}
    for group in optimizer.param_groups:
        group["params"] = [by_local.get(id(t), t) for t in group["params"]]
    for p, local, before in swapped:
        local.grad = None
        if local in optimizer.state:  # the same DTensors where the step updated them in place
            optimizer.state[p] = {
                k: before[k] if k in before and _local(before[k]) is v else _like(v, p)
                for k, v in optimizer.state.pop(local).items()
            }


def _local(value: Any) -> Any:
    return value._local_tensor if isinstance(value, DTensor) else value


def _like(value: Any, param: DTensor) -> Any:
    """A state tensor of the local shard's shape, as a DTensor laid out as its parameter."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param._local_tensor.shape:
        return DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return value
