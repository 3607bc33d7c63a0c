"""The state of any model an own loop holds (plain, DDP, FSDP2 `fully_shard`, FSDP1), saved
whole or sharded, and loaded back into any of them.

Whole: one file, written by rank 0, in the same format for every kind of model: plain
tensors (`torch.load(p, weights_only=True)` works, and `load_state_dict` into a plain model),
the optimizer's state_dict numbered as torch numbers it. A sharded model's state is gathered
to rank 0 first (a collective: every rank must call it). Sharded: a folder written by every
rank with torch.distributed.checkpoint (checkpoint/sharded.py), read back at any world size.

Without this, a model sharded by the user's own `fully_shard` saved rank 0's half of each
parameter as DTensors, silently (issue 15).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import DdpkitError
from .file import atomic_save, load_file, model_signature
from .state import all_finite, optimizer_state_by_name, plain_state_dict, unwrap

FORMAT = "ddpkit-state"


def is_sharded(model: nn.Module) -> bool:
    """Does the model hold DTensors (FSDP2, tensor parallel) or is it wrapped by FSDP1?"""
    from torch.distributed.tensor import DTensor

    if any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()):
        return True
    return any(isinstance(t, DTensor) for t in unwrap(model).state_dict().values())


def check_savable(model: nn.Module) -> None:
    """Refuse what cannot be written whole, before any rank starts a collective."""
    meta = [n for n, t in unwrap(model).state_dict().items() if isinstance(t, torch.Tensor) and t.is_meta]
    if meta:
        raise DdpkitError(
            f"cannot save: {meta[0]} (and {len(meta) - 1} more) are on the meta device (shapes without data): "
            "materialise the model (to_empty + init) before saving"
        )


def whole_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain weights on this rank's CPU (rank 0 only when gathered from shards: {} elsewhere)."""
    check_savable(model)
    if not is_sharded(model):
        return plain_state_dict(model)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: _plain(k, v) for k, v in state.items()}


def whole_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state_dict as torch numbers it (parameter index per group), with
    every tensor whole; gathered to rank 0 when the model is sharded ({} elsewhere)."""
    check_optimizer_of(model, optimizer)
    if not is_sharded(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    named = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not named.get("param_groups"):
        return {}  # not rank 0: it holds nothing after a cpu_offload gather
    order = [fqn for g in named["param_groups"] for fqn in g["params"]]
    index = {fqn: i for i, fqn in enumerate(order)}
    groups, start = [], 0
    for g in named["param_groups"]:
        groups.append({**g, "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    state = {index[fqn]: {k: _plain(f"{fqn}.{k}", v) for k, v in s.items()} for fqn, s in named["state"].items()}
    return {"state": state, "param_groups": groups}


def _plain(name: str, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and not isinstance(value, nn.Parameter):
            raise DdpkitError(
                f"cannot save {name} whole: it is still a {type(value).__name__} after gathering; "
                "save it sharded instead (rt.save(path, model, opt, sharded=True))"
            )
        return value.detach().to("cpu", copy=True)
    return value


def check_optimizer_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    own = {id(p) for p in model.parameters()}
    if any(id(p) not in own for g in optimizer.param_groups for p in g["params"]):
        raise DdpkitError(
            "the optimizer holds parameters that are not this model's (built before rt.wrap sharded it?): "
            "pass it to rt.wrap(model, optimizer) or build it over the wrapped model's parameters"
        )


def save_whole(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any],
    is_main: bool,
) -> None:
    """Collective when the model is sharded: every rank gathers, rank 0 writes atomically."""
    if not is_main and not is_sharded(model):
        check_savable(model)  # the same refusal on every rank
        if optimizer is not None:
            check_optimizer_of(model, optimizer)
        return  # a whole replica: rank 0 alone copies and writes it
    model_state = whole_model_state(model)
    optim_state = whole_optimizer_state(model, optimizer) if optimizer is not None else None
    if not is_main:
        return
    if not all_finite(model_state.values()):
        raise DdpkitError(f"cannot save {path}: the weights hold NaN/inf")
    state: dict[str, Any] = {"format": FORMAT, "model": model_state, "extra": extra}
    if optim_state is not None:
        state["optimizer"] = optim_state
    try:
        atomic_save(state, path)
    except OSError as e:
        raise DdpkitError(f"cannot write {path}: {e.strerror or e}; nothing partial was left") from None


def load_whole(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """A whole file into a plain, DDP or sharded model (each rank keeps its part); returns the extras."""
    state = load_file(path)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise DdpkitError(f"{path}: not a file written by ddpkit's save (rt.save)")
    target = unwrap(model)
    if model_signature(target.state_dict()) != model_signature(state["model"]):
        raise DdpkitError(f"{path}: saved model does not match this model (different parameter names or shapes)")
    if optimizer is not None and "optimizer" not in state:
        raise DdpkitError(f"{path}: holds no optimizer state")
    if not is_sharded(model):
        target.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
        return state.get("extra", {})
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    options = StateDictOptions(full_state_dict=True)
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=options)
        return state.get("extra", {})
    check_optimizer_of(model, optimizer)
    saved = state["optimizer"]
    if [len(g["params"]) for g in saved["param_groups"]] != [len(g["params"]) for g in optimizer.param_groups]:
        raise DdpkitError(f"{path}: the saved optimizer has different parameter groups than this one")
    named = optimizer_state_by_name(model, optimizer, saved)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=named, options=options)
    return state.get("extra", {})


def saved_kind(path: str | os.PathLike) -> str:
    """'sharded' for a folder of torch.distributed.checkpoint shards, else 'whole'."""
    return "sharded" if Path(path).is_dir() else "whole"
