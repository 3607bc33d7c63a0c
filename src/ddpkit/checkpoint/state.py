"""The pieces of a checkpoint that any kind shares: the plain weights of a wrapped model
(no `module.` prefix, whatever wraps it) and every random state of a process."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass(frozen=True)
class Position:
    """Where training stands: `epoch` epochs done, plus `step` steps of the next one
    (a stop between steps), with the global loss sum and count (samples, or a step hook's
    tokens) of those steps."""

    epoch: int = 0
    step: int = 0
    loss_sum: float = 0.0
    count_sum: float = 0.0
    global_step: int = 0  # optimizer steps done in the whole run


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside any wrapper (state_dict keys without `module.`)."""
    while isinstance(model, DDP) or hasattr(model, "_orig_mod"):
        model = model.module if isinstance(model, DDP) else model._orig_mod  # type: ignore[assignment]
    return model


def optimizer_state_by_name(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state_dict numbered as torch numbers it (the i-th parameter of the groups
    in order) keyed by parameter names instead, as torch.distributed.checkpoint's
    set_state_dict takes it: how a whole state goes into a sharded model's optimizer."""
    names = {id(p): n for n, p in unwrap(model).named_parameters()}
    fqns = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    return {"state": {fqns[i]: s for i, s in saved["state"].items()},
            "param_groups": [{**g, "params": [fqns[i] for i in g["params"]]} for g in saved["param_groups"]]}


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unwrapped model's weights, detached copies on the CPU."""
    return {k: v.detach().to("cpu", copy=True) for k, v in unwrap(model).state_dict().items()}


def rng_state() -> dict[str, Any]:
    """This process's random states, as tensors and plain Python values only."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
