"""Sharding data across ranks so that the world size does not change the result.

ddpkit draws ONE global sample order per epoch (from the seed and the epoch, the same on
every rank and for every world size) and cuts it into global batches of
``world_size x batch_size`` samples. Rank r trains on the r-th contiguous slice of each
global batch. So ``--nproc 2 --batch-size 16`` sees exactly the batches of
``--nproc 1 --batch-size 32``, and DDP's gradient average equals the single-process mean.

The rest: when the data set does not divide into whole global batches, the last global
batch is smaller; it is split as evenly as possible (the first ranks get one sample more,
a rank may get none) and the trainer weights each rank's loss by its share, so the step
is still the mean over exactly those samples. No sample is dropped or repeated.

Evaluation shards the eval set into contiguous, unpadded slices and sums counts across
ranks, so every eval sample is counted exactly once (a DistributedSampler would pad by
repeating samples).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from ..util.tree import map_tensors
from .placement import ON_DEVICE, indices_to, tensors_of, to_device_once
from .samples import RankBatches


def global_order(n: int, epoch: int, seed: int, shuffle: bool = True) -> torch.Tensor:
    """The epoch's sample order, identical on every rank and for every world size."""
    if not shuffle:
        return torch.arange(n)
    g = torch.Generator()
    g.manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


def split_even(count: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` when `count` items are split into `parts` contiguous
    parts whose sizes differ by at most one (the first parts get the extra items)."""
    base, extra = divmod(count, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class Step:
    """One step of one rank: its sample indices and the size of the whole global batch."""

    indices: torch.Tensor
    global_count: int


class ShardedLoader(RankBatches):
    """Batches of this rank's share of a data set, in the global order. Call set_epoch()
    before each epoch (the order changes every epoch, identically on all ranks).

    Iterating yields collated batches, as a DataLoader does. Data sets that are
    TensorDatasets are batched by indexing their tensors (no per-item Python calls); with
    `device`, on that device, where their tensors are placed once (placement.py): the same
    indices in the same order, so the same batches.

    The position in an epoch is a number of samples of the global order (the same on every
    rank): state() records it, load() continues from exactly that sample at any world size,
    batch size or accumulation, so a resumed epoch trains every sample once.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        num_workers: int = 0,
        global_batch: int | None = None,
        device: torch.device | None = None,
    ) -> None:
        """`batch_size`: this rank's samples per step, the global batch world x that; or
        `global_batch` samples per step, split as evenly as it goes (shares differ by one).
        `device`: a TensorDataset's tensors go there once and every batch is indexed there."""
        if batch_size < 1:
            raise ValueError("batch_size must be positive")
        self.fixed_global_batch = global_batch
        self.dataset = dataset
        self.n = len(dataset)  # type: ignore[arg-type]
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.epoch = 0
        self.taken = 0  # samples of this epoch's global order handed out so far (all ranks)
        self._resume_at: tuple[int, int] | None = None  # (epoch, samples) from load()
        self.device = device
        self.placed: tuple[torch.Tensor, ...] | None = None
        if device is not None:
            columns = tensors_of(dataset)
            if columns is None:
                raise ValueError("only a TensorDataset's tensors can be placed on a device")
            self.placed = to_device_once(columns, device)
            self.data = ON_DEVICE

    def __len__(self) -> int:
        """Steps of a whole pass."""
        return self.steps_left(0)

    def steps_left(self, start: int) -> int:
        """Steps of the pass after its first `start` samples."""
        full, rest = divmod(max(0, self.n - start), self.global_batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def steps(self, start: int = 0) -> Iterator[Step]:
        """This rank's index slices for the current epoch, from sample `start` of the global order,
        one step at a time: a list of the whole epoch's steps (~40 us each) would make an epoch's
        start, and a resume early in it, cost time in proportion to the epoch's length."""
        order = global_order(self.n, self.epoch, self.seed, self.shuffle)[start:]
        if self.device is not None:
            order = indices_to(order, self.device)  # once per pass: every step's indices are slices of it
        for s in range(self.steps_left(start)):
            batch = order[s * self.global_batch_size : (s + 1) * self.global_batch_size]
            lo, hi = split_even(len(batch), self.world_size, self.rank)
            yield Step(batch[lo:hi], len(batch))

    def start(self) -> int:
        """Where this epoch's iteration begins: a loaded position in it, else its first sample."""
        at = self._resume_at
        return at[1] if at is not None and at[0] == self.epoch else 0

    def iter_steps(self) -> Iterator[tuple[Any, int, int]]:
        """Yields (batch, local_count, global_count) for each step of the epoch, from the
        loaded position when there is one (resuming mid-epoch)."""
        start = self.start()
        self._resume_at = None
        self.taken = start
        steps, ahead = itertools.tee(self.steps(start))
        index_lists = (s.indices for s in ahead)
        if self.placed is not None:
            batches = (tuple(t.index_select(0, idx) for t in self.placed) for idx in index_lists)
        else:
            batches = fetch_batches(self.dataset, index_lists, self.num_workers)
        for step, batch in zip(steps, batches, strict=True):
            self.taken += step.global_count
            yield batch, len(step.indices), step.global_count

    def __iter__(self) -> Iterator[Any]:
        for batch, _, _ in self.iter_steps():
            yield batch

    def state(self) -> dict[str, Any]:
        """The position in the epoch: identical on every rank, so any rank's copy will do."""
        return {"epoch": self.epoch, "samples": self.taken, "global_batch": self.global_batch_size}

    def load(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Continue the saved epoch at its saved sample (state() of any rank, or the list of
        every rank's, as a stream's load takes); set_epoch() with that epoch comes next."""
        state = state[0] if isinstance(state, list) else state
        self.epoch = int(state["epoch"])
        self._resume_at = (self.epoch, int(state["samples"]))


def fetch_batches(dataset: Dataset, index_lists: Iterable[torch.Tensor], num_workers: int = 0) -> Iterator[Any]:
    """Collated batches for the given index lists: tensor indexing for TensorDatasets,
    a DataLoader (optionally with worker processes) for anything else."""
    if isinstance(dataset, TensorDataset):
        for idx in index_lists:
            yield tuple(t[idx] for t in dataset.tensors)
        return
    if num_workers == 0:
        for idx in index_lists:
            yield _collate(dataset, [dataset[i] for i in idx.tolist()])
        return
    lists = [idx.tolist() for idx in index_lists]
    # A DataLoader does not call collate for an empty index list, so keep empty shares here.
    nonempty = [idx for idx in lists if idx]
    loader = iter(DataLoader(dataset, batch_sampler=nonempty, num_workers=num_workers))
    for idx in lists:
        yield next(loader) if idx else _collate(dataset, [])


def _collate(dataset: Dataset, items: list) -> Any:
    if items:
        return default_collate(items)
    # A rank's empty share of a short last batch: a zero-length batch shaped like a sample.
    return map_tensors(default_collate([dataset[0]]), lambda t: t[:0])


def shard_range(n: int, rank: int, world_size: int) -> range:
    """This rank's contiguous, unpadded slice of n eval samples."""
    lo, hi = split_even(n, world_size, rank)
    return range(lo, hi)


def eval_batches(
    dataset: Dataset, batch_size: int, rank: int, world_size: int, num_workers: int = 0, lockstep: bool = False
) -> Iterator[Any]:
    """This rank's eval samples, each exactly once over all ranks, in batches. With
    `lockstep` every rank yields as many batches as the rank with the most, the missing ones
    empty (zero-length): a sharded (FSDP) model needs every rank in every forward."""
    n = len(dataset)  # type: ignore[arg-type]
    part = shard_range(n, rank, world_size)
    share = torch.arange(part.start, part.stop)
    chunks = [share[i : i + batch_size] for i in range(0, len(share), batch_size)]
    if lockstep:
        most = _ceil_div(_ceil_div(n, world_size), batch_size)  # the first rank's count of batches
        chunks += [share[:0]] * (most - len(chunks))
    yield from fetch_batches(dataset, chunks, num_workers)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
