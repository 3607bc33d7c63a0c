"""The blocks of a model: the units FSDP shards one by one and activation checkpointing
recomputes one by one (a transformer's layers). Plain nn, so DDP runs need no FSDP import."""

from __future__ import annotations

from typing import Callable, Iterable

from torch import nn

BlocksHook = Callable[[nn.Module], Iterable[nn.Module]]


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP shards (and activation checkpointing recomputes) one by one: every
    element of the model's outermost nn.ModuleLists (transformer layers, MLP stacks); without
    any, the children of a Sequential root that hold parameters. Whatever is left (embeddings,
    head) goes to FSDP's root unit."""
    blocks: list[nn.Module] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue
        if isinstance(module, nn.ModuleList):
            for i, child in enumerate(module):
                if _has_params(child):
                    blocks.append(child)
                    inside.append(f"{name}.{i}" if name else str(i))
    if not blocks and isinstance(model, nn.Sequential):
        blocks = [child for child in model if _has_params(child)]
    return blocks


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())
