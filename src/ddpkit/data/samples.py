"""What a batch holds, whatever its structure: its first tensor and its number of samples."""
from __future__ import annotations

from typing import Any

import torch

from ..errors import DdpkitError


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The first tensor in a nested structure (dict values in order), or None."""
    if isinstance(obj, torch.Tensor):
        return obj
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for v in values:
        t = first_tensor(v)
        if t is not None:
            return t
    return None


def sample_count(batch: Any) -> int:
    """The batch's samples: its first tensor's length."""
    t = first_tensor(batch)
    if t is None or t.dim() == 0:
        raise DdpkitError(f"a batch must hold at least one tensor with a batch dimension; got {type(batch).__name__} "
                          "(items of a data set must be tensors, numbers, or a tuple/dict of them)")
    return int(t.shape[0])
