"""Walking the nested structures batches and states are made of (tensors in dicts, lists,
tuples, namedtuples): the one walk that moving a batch, cutting an empty share, copying a
state to the CPU and finding a batch's first tensor all use."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`obj` with every tensor replaced by fn(tensor); containers rebuilt (a subclass of tuple
    such as a namedtuple comes back as a plain tuple), anything else kept as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        kind = type(obj) if type(obj) in (list, tuple) else tuple
        return kind(map_tensors(v, fn) for v in obj)
    return obj


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in `obj`, in order (dict values in their order)."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for v in values:
        yield from tensors(v)
