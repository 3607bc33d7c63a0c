"""Activation checkpointing: keep each block's input instead of everything its forward saves
for backward, and run the block's forward again during backward to get the rest.

Per block, the same blocks FSDP shards by default (the task's `fsdp_blocks`, else
`default_blocks`: a model's layers), or the task's own `checkpoint_blocks` choice (every
other layer, say, to trade less recomputation for more memory). Applied before anything
else touches the model (torch.compile, DDP, fully_shard), as torch's own recipes order them.

torch's composable `checkpoint`, non-reentrant: it hooks the block's forward instead of
wrapping the block in another module, so parameter names and checkpoint keys stay what they
were (a checkpoint written with it loads without it, and back); it restores the RNG state
for the recomputation (dropout draws the same masks twice); and FSDP's hooks on the block
all-gather its parameters again for the recomputation.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from torch import nn

from ..errors import DdpkitError
from .blocks import BlocksHook, default_blocks

NO_BLOCKS = (
    "activation checkpointing found no blocks to checkpoint in {model}: it checkpoints the elements "
    "of the model's outermost nn.ModuleList (its layers), else the children of an nn.Sequential. "
    "Name the blocks with Task(checkpoint_blocks=lambda model: model.layers) (rt.wrap(..., "
    "checkpoint_blocks=...) in your own loop), or drop --activation-checkpointing"
)


def checkpoint_blocks(model: nn.Module, blocks: BlocksHook | None = None) -> list[nn.Module]:
    """Non-reentrant activation checkpointing on each of `blocks(model)` (default: FSDP's
    default_blocks); returns the blocks. Refuses a model without any, the model itself, a
    module that is not the model's, and a block inside another (it would run three times)."""
    from torch.distributed._composable import checkpoint

    chosen = list((blocks or default_blocks)(model))
    if not chosen:
        raise DdpkitError(NO_BLOCKS.format(model=type(model).__name__))
    own = {id(m) for m in model.modules()}
    if any(b is model or not isinstance(b, nn.Module) or id(b) not in own for b in chosen):
        raise DdpkitError(
            "the task's checkpoint_blocks(model) must return submodules of the model (not the model itself)"
        )
    inside = {id(m) for b in chosen for m in b.modules() if m is not b}
    if len({id(b) for b in chosen}) != len(chosen) or any(id(b) in inside for b in chosen):
        raise DdpkitError(
            "the task's checkpoint_blocks(model) returned a block twice or a block inside another: "
            "name each layer once, at one level"
        )
    _no_key_value_cache(model)
    for block in chosen:
        checkpoint(block)
    return chosen


def has_blocks(model: nn.Module, blocks: BlocksHook | None = None) -> bool:
    """Would --activation-checkpointing find blocks to checkpoint in `model` (checkpoint_blocks')?"""
    try:
        return bool(list((blocks or default_blocks)(model)))
    except Exception:  # a task's hook that fails says so when it is used, not here
        return False


def _no_key_value_cache(model: nn.Module) -> None:
    """A Hugging Face model in training still fills a key/value cache (config.use_cache) that
    its blocks share: a block run again for its activations would append its keys a second
    time (measured on GPT-2: attention over 128 keys of 64 tokens, a crash). Off, as
    transformers' own gradient checkpointing turns it off; it only serves generation."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True:
            config.use_cache = False


def is_checkpointed(module: nn.Module) -> bool:
    """Whether checkpoint_blocks hooked this module (for tests and the summary)."""
    from torch.distributed._composable import checkpoint

    return checkpoint.state(module) is not None


class SavedBytes:
    """What one forward keeps for its backward: each storage autograd saves, once (parameters
    and views of them left out: they are the model's, not activations), and the inputs each
    checkpointed block holds for its recomputation. With `blocks` (none of them checkpointed),
    what is saved while a block runs is kept apart per block, and each block's input too: what
    the plan needs to model checkpointing without applying it.

    `with SavedBytes(checkpointed) as saved: loss = forward()`, then saved.kept() (bytes). It
    only counts: autograd gets the same storage back, detached (no reference cycle)."""

    def __init__(self, checkpointed: Iterable[nn.Module] = (), blocks: Iterable[nn.Module] = ()) -> None:
        self.outside: dict[int, int] = {}  # storage -> bytes, saved outside every block
        self.inside: list[dict[int, int]] = []  # saved while block i ran
        self.inputs: dict[int, int] = {}  # the blocks' inputs
        self._running: list[int] = []
        self._held: list[Any] = []  # the inputs, alive while counting: no other tensor takes their address
        self._checkpointed = list(checkpointed)
        self._blocks = list(blocks)
        self._handles: list[Any] = []
        self._hooks: Any = None

    def kept(self, checkpointing: bool | None = None) -> int:
        """Bytes alive from the forward to its backward: as measured (None), or as they would
        be with checkpointing on the blocks (True: outside and the blocks' inputs) or without
        (False: everything saved)."""
        parts = [self.outside, *self.inside] if not checkpointing else [self.outside]
        if checkpointing is not False:
            parts.append(self.inputs)
        return _bytes(*parts)

    def recomputed(self) -> int:
        """With checkpointing, the most a block's recomputation adds during backward."""
        kept = {**self.outside, **self.inputs}
        return max((_bytes({k: v for k, v in b.items() if k not in kept}) for b in self.inside), default=0)

    def __enter__(self) -> SavedBytes:
        import torch

        self.inside = [{} for _ in self._blocks]
        for i, block in enumerate(self._blocks):
            self._handles.append(block.register_forward_pre_hook(self._entering(i), with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._leaving, always_call=True))
        for block in self._checkpointed:
            self._handles.append(block.register_forward_pre_hook(self._entering(None), with_kwargs=True))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._held.clear()

    def _entering(self, i: int | None) -> Callable[..., None]:
        def hook(_: nn.Module, args: Any, kwargs: Any) -> None:
            import torch
            from torch.utils._pytree import tree_leaves

            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    self._held.append(t)
                    self.inputs[_storage(t)] = t.untyped_storage().nbytes()
            if i is not None:
                self._running.append(i)

        return hook

    def _leaving(self, *_: Any) -> None:
        self._running.pop()

    def _pack(self, t: Any) -> Any:
        base = t._base if t._base is not None else t
        if not (base.is_leaf and base.requires_grad):
            where = self.inside[self._running[-1]] if self._running else self.outside
            where[_storage(t)] = t.untyped_storage().nbytes()
        return t.detach()


def _storage(t: Any) -> int:
    """Which storage `t` lives in: torch's own handle of it (on the meta device too, where
    every tensor's data pointer is 0)."""
    return int(t.untyped_storage()._cdata)


def _bytes(*parts: dict[int, int]) -> int:
    """Each storage once, however many of `parts` hold it."""
    merged: dict[int, int] = {}
    for part in parts:
        merged.update(part)
    return sum(merged.values())
