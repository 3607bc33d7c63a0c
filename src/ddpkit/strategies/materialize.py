"""A model built on the meta device (shapes without memory) becomes this rank's part of it,
initialised; then, with a pretrained file, the file's weights go into that part.

Why module by module: the point of a meta build is that no rank ever holds the whole model.
Each module that owns parameters or buffers gets them full-size on the CPU for a moment (so
the values come from the same RNG calls in the same order as an eager CPU build), its own
`reset_parameters()` (or the task's `init_weights(module)`) fills them, and this rank keeps
only its slice, found from each DTensor's placements (any mesh: FSDP's 1-D, HSDP's 2-D), or
the whole tensor when it is not distributed (DDP). The full copy is freed before the next.

Equal to the eager build under the same seed: an eager build draws each module's
`reset_parameters()` while it is constructed, in registration order, then the task's
`init_weights` would be applied afterwards over the whole model. Two passes replay that:
pass 1 resets every module in `model.modules()` order (a tied parameter keeps the first
module's values, as a tie made after construction does), pass 2 calls `init_weights` on
every module from the values pass 1 left (gathered), the last writer winning.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..checkpoint.pretrained import load_pretrained, local_shape_and_offset, open_pretrained, tensor_names
from ..errors import DdpkitError

InitHook = Callable[[nn.Module], Any]


@dataclass(frozen=True)
class ModelInit:
    """How this run's model gets its first weights: `init_weights(module)` for a meta build
    (else each module's reset_parameters), the RNG seed those draw from (None: the RNG as it
    is), and a pretrained file or folder to load into whatever the model is."""

    init_weights: InitHook | None = None
    init_from: str | None = None
    seed: int | None = None


def on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in _all_tensors(model))


def fill(model: nn.Module, device: torch.device, init: ModelInit) -> nn.Module:
    """Materialise a meta model's tensors on `device` (this rank's part of each) and load the
    pretrained weights when asked. Collective under FSDP: every rank calls it."""
    source = open_pretrained(init.init_from, tensor_names(model)) if init.init_from else None
    try:
        if on_meta(model):
            from_file = source.covered if source is not None else set()
            materialize(model, device, init, from_file)
        if source is not None:
            load_pretrained(model, source)
    finally:
        if source is not None:
            source.close()
    return model


def materialize(model: nn.Module, device: torch.device, init: ModelInit, from_file: set[int] = frozenset()) -> None:
    """Every module owning meta tensors gets them on `device`, initialised (see the module's
    docstring); tensors whose ids are in `from_file` all come from a pretrained file, so a
    module holding only those is allocated and left for the loader."""
    names = {id(m): n or "the model" for n, m in model.named_modules()}
    todo = [m for m in model.modules() if any(t.is_meta for t in _own(m).values())]
    needs_init = [m for m in todo if any(id(t) not in from_file for t in _own(m).values())]
    hook = init.init_weights
    if hook is None:
        for m in needs_init:
            if not callable(getattr(m, "reset_parameters", None)):
                raise DdpkitError(
                    f"the model is built on the meta device, but {names[id(m)]} ({type(m).__name__}) has no "
                    "reset_parameters() to initialise its parameters/buffers: give the task "
                    "init_weights=fn(module) (ddpkit.Task), or build the model eagerly"
                )
    for m in todo:
        _allocate(m, device)
    pending = {id(m) for m in needs_init}
    with _rng(init.seed), torch.no_grad():
        seen: set[int] = set()
        for m in needs_init:  # pass 1: what constructing the module would have drawn
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                _init_module(m, reset, seen, from_current=False, first_wins=True)
                pending.discard(id(m))
                if hook is None:
                    _check_set(m, names[id(m)], "reset_parameters()")
        if hook is not None:
            for m in needs_init:  # pass 2: the task's init over the whole model, in order
                _init_module(m, lambda m=m: hook(m), seen, from_current=id(m) not in pending, first_wins=False)
                _check_set(m, names[id(m)], "init_weights")


def _allocate(module: nn.Module, device: torch.device) -> None:
    """Memory for the module's own meta tensors, keeping each tensor object: a parameter tied
    to another module's stays one, and whatever holds it (an optimizer) holds the new one."""
    own = _own(module)
    if any(hasattr(t, "placements") for t in own.values()):
        module.to_empty(device=device, recurse=False)  # DTensors: swapped in place by nn.Module._apply
        return
    for t in own.values():
        if t.is_meta:
            new = torch.empty_like(t, device=device)
            torch.utils.swap_tensors(
                t, nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
            )


def _init_module(
    module: nn.Module, fn: Callable[[], Any], seen: set[int], from_current: bool, first_wins: bool
) -> None:
    """Run `fn` with the module's own tensors swapped for full-size CPU ones, then copy this
    rank's slice of each back. Unset values start as NaN, so that one left unset is caught."""
    own = _own(module)
    full = {}
    for name, t in own.items():
        if from_current or (id(t) in seen and not first_wins):
            full[name] = _gather(t).cpu()
        else:
            full[name] = torch.full(t.shape, float("nan") if t.is_floating_point() else 0, dtype=t.dtype)
    with _swapped(module, full):
        fn()
    for name, t in own.items():
        if not (first_wins and id(t) in seen):
            _local(t).copy_(_my_slice(t, full[name].detach()))
        seen.add(id(t))
    del full


def _check_set(module: nn.Module, name: str, what: str) -> None:
    for tname, t in _own(module).items():
        local = _local(t)
        if local.is_floating_point() and local.numel() and bool(torch.isnan(local).any()):
            raise DdpkitError(
                f"the model is built on the meta device, but {what} left {name}.{tname} ({type(module).__name__}) "
                "unset: set every parameter and buffer there (values computed in __init__ do not exist on meta), "
                "or build the model eagerly"
            )


@contextlib.contextmanager
def _swapped(module: nn.Module, full: dict[str, torch.Tensor]) -> Iterator[None]:
    """The module's own tensors replaced by `full` while its init runs (then the originals back)."""
    saved_p, saved_b = dict(module._parameters), dict(module._buffers)
    for name, value in full.items():
        if name in saved_p:
            module._parameters[name] = nn.Parameter(value, requires_grad=saved_p[name].requires_grad)
        else:
            module._buffers[name] = value
    try:
        yield
    finally:
        for name in full:  # read the results before putting the originals back
            full[name] = module._parameters[name] if name in saved_p else module._buffers[name]
        module._parameters.update(saved_p)
        module._buffers.update(saved_b)


def _own(module: nn.Module) -> dict[str, torch.Tensor]:
    own = {n: p for n, p in module._parameters.items() if p is not None}
    own.update({n: b for n, b in module._buffers.items() if b is not None})
    return own


def _all_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _gather(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def _my_slice(t: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The part of the full tensor this rank keeps of `t`: by its placements when it is a DTensor."""
    if not hasattr(t, "placements"):
        return full
    shape, offset = local_shape_and_offset(t)
    for dim, (n, start) in enumerate(zip(shape, offset, strict=True)):
        full = full.narrow(dim, start, n)
    return full


@contextlib.contextmanager
def _rng(seed: int | None) -> Iterator[None]:
    """With a seed: the CPU RNG from that seed (as the eager build drew right after ddpkit's
    seed), then back to where the caller's was."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[set[int]]:
    """Every parameter a module registers goes to the meta device (its shape and dtype, no
    memory, and an initialisation that costs nothing); buffers, data and everything else stay
    as built. What the memory plan builds a task in: its sizes without the model's memory.
    Yields the ids of the parameters it put there (a model with none of them: the task built
    it on the meta device itself)."""
    original = nn.Module.register_parameter
    moved: set[int] = set()

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            moved.add(id(param))
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield moved
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
