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
    """Where training stands, independent of the world size: `epoch` epochs done, plus the
    first `samples` samples of the next epoch's global order (a stop between steps), with the
    global loss sum and count (samples, or a step hook's tokens) of those samples.
    `global_step`: optimizer steps done in the whole run; `global_batch`: the global batch
    (processes x --batch-size x --accumulate) the position was written with, kept to say
    what changed. A position in samples resumes exactly at any world size and batch."""

    epoch: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    count_sum: float = 0.0
    global_step: int = 0
    global_batch: int = 0

    @property
    def mid_epoch(self) -> bool:
        return self.samples > 0

    @property
    def name_step(self) -> int:
        """The step in a checkpoint's name (epoch-E-step-S): the run's optimizer step of a
        mid-epoch checkpoint (it grows monotonically whatever the world size), 0 at an epoch's end."""
        return self.global_step if self.mid_epoch else 0

    def fields(self) -> dict[str, Any]:
        """The position as a checkpoint stores it (both kinds write these keys)."""
        return {
            "epoch": self.epoch,
            "samples": self.samples,
            "loss_sum": self.loss_sum,
            "count_sum": self.count_sum,
            "global_step": self.global_step,
            "global_batch": self.global_batch,
        }


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside any wrapper (state_dict keys without `module.`)."""
    while isinstance(model, DDP) or hasattr(model, "_orig_mod"):
        model = model.module if isinstance(model, DDP) else model._orig_mod  # type: ignore[assignment]
    return model


def optimizer_state_by_name(
    model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]
) -> dict[str, Any]:
    """An optimizer state_dict numbered as torch numbers it (the i-th parameter of the groups
    in order) keyed by parameter names instead, as torch.distributed.checkpoint's
    set_state_dict takes it: how a whole state goes into a sharded model's optimizer."""
    names = {id(p): n for n, p in unwrap(model).named_parameters()}
    fqns = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    return {
        "state": {fqns[i]: s for i, s in saved["state"].items()},
        "param_groups": [{**g, "params": [fqns[i] for i in g["params"]]} for g in saved["param_groups"]],
    }


def whole_param_groups(model: nn.Module, optim_state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by name (torch's get_state_dict) whose param groups list the
    whole model's parameters where this rank holds only a part of its layers (a pipeline stage's
    `whole_group_names`). DCP writes one copy of an item every rank saves under one key, the
    groups' lists included: a stage's own list would leave the other stages' parameters without
    their group's settings on resume. The state itself stays this rank's."""
    names = getattr(unwrap(model), "whole_group_names", None)
    if names is None:
        return optim_state
    groups = optim_state["param_groups"]
    if len(groups) != len(names):
        raise ValueError(f"{len(groups)} optimizer param groups on this stage, {len(names)} in the whole model")
    return {**optim_state, "param_groups": [{**g, "params": list(n)} for g, n in zip(groups, names, strict=True)]}


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unwrapped model's weights, detached copies on the CPU."""
    return {k: v.detach().to("cpu", copy=True) for k, v in unwrap(model).state_dict().items()}


def weights_to_save_now(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` on the CPU for a save that is written before the model changes again: a CPU
    tensor as it is (no copy: the end of a run must not hold the model twice), one that views
    a larger storage cloned (torch.save writes a tensor's whole storage)."""
    out = {}
    for k, v in state.items():
        v = v.detach().to("cpu")
        out[k] = v if v.untyped_storage().nbytes() == v.numel() * v.element_size() else v.clone()
    return out


def rng_state() -> dict[str, Any]:
    """This process's random states, as tensors and plain Python values only."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "name": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "gauss": float(np_state[4]),
        },
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


def all_finite(ts: Any) -> bool:
    """Whether every floating-point tensor of `ts` (a rank's shards: their local parts) is finite."""
    return all(torch.isfinite(t.to_local() if hasattr(t, "to_local") else t).all() for t in ts if t.is_floating_point())


def weights_finite(model: nn.Module, collectives: Any, device: torch.device, taken: bool = False) -> tuple[bool, bool]:
    """Whether every weight of every rank is finite (each rank checks what it holds: its
    shards, or its replica), the same answer on every rank: a checkpoint of NaN weights would
    replace the last good one. With it, in the same all-reduce: whether any rank found the run
    directory `taken` by another world (world_mark.py)."""
    flag = torch.tensor(
        [0.0 if all_finite(model.parameters()) else 1.0, 1.0 if taken else 0.0], dtype=torch.float64, device=device
    )
    if collectives is not None:
        collectives.all_reduce_(flag)
    bad, lost = flag.tolist()
    return bad == 0, lost > 0
