"""The one choice between a map-style set's loader and a stream's, made alike for
`ddpkit train` and an own loop's rt.loader."""

from __future__ import annotations

from typing import Any

from ..runtime import Runtime
from .sharding import ShardedLoader
from .streams import StreamLoader, is_stream


def rank_loader(
    dataset: Any, batch_size: int, rt: Runtime, seed: int = 0, shuffle: bool = True, **options: Any
) -> ShardedLoader | StreamLoader:
    """This rank's batches of `dataset` in ddpkit's global order. A stream's ranks agree where
    a pass ends through the job's collectives, on the device the backend moves (the GPU
    under NCCL, else the CPU). The rank and world are the data-parallel ones (rt.dims): the ranks of
    one tensor-parallel group, and the stages of one pipeline, get the same samples. `options`: the
    loader's own (num_workers; drop_last for a map-style set)."""
    if is_stream(dataset):
        return StreamLoader(
            dataset,
            batch_size,
            rt.dims.dp_rank,
            rt.dims.dp,
            seed=seed,
            shuffle=shuffle,
            agree=rt.collectives.all_reduce_,
            device=rt.collective_device,
            **options,
        )
    return ShardedLoader(dataset, batch_size, rt.dims.dp_rank, rt.dims.dp, seed=seed, shuffle=shuffle, **options)
