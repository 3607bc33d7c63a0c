"""What a batch holds, whatever its structure: its first tensor and its number of samples."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import DdpkitError
from ..util.tree import tensors


class RankBatches:
    """What the loop needs of either loader (sharding.ShardedLoader, streams.StreamLoader):
    the global batch of one step, and the epoch (pass) it is in."""

    batch_size: int
    world_size: int
    epoch: int = 0
    fixed_global_batch: int | None = None  # --global-batch-size: shares of it, not world x batch_size
    data: str = "loader"  # which path gathers the batches: "on device" (data/placement.py) or "loader"

    @property
    def global_batch_size(self) -> int:
        return self.fixed_global_batch or self.batch_size * self.world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The first tensor in a nested structure (dict values in order), or None."""
    return next(tensors(obj), None)


def sample_count(batch: Any) -> int:
    """The batch's samples: its first tensor's length."""
    t = first_tensor(batch)
    if t is None or t.dim() == 0:
        raise DdpkitError(
            f"a batch must hold at least one tensor with a batch dimension; got {type(batch).__name__} "
            "(items of a data set must be tensors, numbers, or a tuple/dict of them)"
        )
    return int(t.shape[0])
