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
    for block in chosen:
        checkpoint(block)
    return chosen


def is_checkpointed(module: nn.Module) -> bool:
    """Whether checkpoint_blocks hooked this module (for tests and the summary)."""
    from torch.distributed._composable import checkpoint

    return checkpoint.state(module) is not None
