"""Streaming data: data sets that are read front to back, never indexed, and may have no length.

Two forms, and how each is shared so that every sample is trained on by exactly one rank
(and one DataLoader worker) once per pass:

  * ShardedStream(shards, read): a list of shards (files, URLs, anything `read(shard)` turns
    into an iterator of samples; `read_lines`, `read_jsonl` and `read_tar` are provided).
    Each pass orders the shards from (seed, pass) and deals them out: shard k of that order
    goes to rank k % world and, on that rank, to worker (k // world) % workers. Every shard
    is read by one reader only. A shard's position (how many samples were taken from it,
    whether it is done) is the stream's state.
  * A Hugging Face `datasets` streaming set (the optional extra) with at least as many
    shards as readers: its own shards, read as above (`ds.shard(n, k)`).
  * Any torch IterableDataset: every reader iterates it and keeps the items whose index
    i satisfies i % readers == reader (readers = world x workers): each item is trained on
    once, but every reader reads the whole stream (give shards to read less). The state is
    how many items of the pass are behind the reader.

Uneven ends: readers run out at different steps. Before every step all ranks agree (one
small all-reduce) whether each has a batch; the pass ends at the first step where one has
none, and the rest of that pass is dropped on every rank (at most the unread part of the
last shards: said in the README). Nothing waits for a collective that others skip.

Resume: every reader's state is in the checkpoint. At the same world size (and workers)
each reader reopens its shards at the saved positions: the same batches follow, and the
model ends bit-identical to an uninterrupted run. At another world size the shards are dealt
out anew; shards already read stay read and each partly read shard continues at its saved
position, so no sample is repeated or skipped (for a plain IterableDataset: the pass
continues after the last item any reader had taken, with a new round-robin).
"""

from __future__ import annotations

import json
import os
import tarfile
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate

from ..errors import DdpkitError
from .samples import RankBatches, first_tensor, sample_count


def read_lines(path: str) -> Iterator[str]:
    """A text file's lines, without their line ends."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield line.rstrip("\n")


def read_jsonl(path: str) -> Iterator[Any]:
    """One JSON value per line (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise DdpkitError(
                        f"{path}:{n}: not JSON ({e.msg}); a .jsonl shard holds one JSON value per line"
                    ) from None


def read_tar(path: str) -> Iterator[dict[str, Any]]:
    """A webdataset-style tar: consecutive files that share a name before the first dot form
    one sample, {"__key__": name, ext: bytes, ...} ("000017.png" + "000017.cls")."""
    with tarfile.open(path) as tar:
        sample: dict[str, Any] = {}
        for member in tar:
            if not member.isfile():
                continue
            base = os.path.basename(member.name)
            key, _, ext = base.partition(".")
            key = os.path.join(os.path.dirname(member.name), key)
            if sample and sample["__key__"] != key:
                yield sample
                sample = {}
            sample.setdefault("__key__", key)
            sample[ext] = tar.extractfile(member).read()  # type: ignore[union-attr]
        if sample:
            yield sample


class ShardedStream(IterableDataset):
    """A stream made of shards, each read by one reader (see the module docstring).
    `read(shard)` returns an iterator of samples; `decode(sample)` turns each into what the
    model takes (tensors, a tuple or a dict of tensors)."""

    def __init__(
        self,
        shards: Sequence[Any],
        read: Callable[[Any], Iterable[Any]] | None = None,
        decode: Callable[[Any], Any] | None = None,
    ) -> None:
        self.shards = list(shards)
        if not self.shards:
            raise DdpkitError("ShardedStream: the shard list is empty: give the files (or other shards) to read")
        self.read = read or _reader_for(self.shards[0])
        self.decode = decode

    def __iter__(self) -> Iterator[Any]:  # plain iteration (one reader), e.g. outside ddpkit
        for shard in self.shards:
            for sample in self.read(shard):
                yield self.decode(sample) if self.decode else sample


def _reader_for(shard: Any) -> Callable[[Any], Iterable[Any]]:
    name = str(shard)
    if name.endswith(".jsonl"):
        return read_jsonl
    if name.endswith((".tar", ".tar.gz", ".tgz")):
        return read_tar
    if name.endswith(".txt"):
        return read_lines
    raise DdpkitError(
        f"ShardedStream: no reader for {name!r}: give read=... (read_lines, read_jsonl, read_tar or your own)"
    )


def is_stream(dataset: Any) -> bool:
    return isinstance(dataset, IterableDataset)


class HfShard:
    """Shard k of a Hugging Face `datasets` IterableDataset (a picklable reader)."""

    def __init__(self, dataset: Any, count: int) -> None:
        self.dataset, self.count = dataset, count

    def __call__(self, k: int) -> Iterator[Any]:
        return hf_rows(self.dataset.shard(num_shards=self.count, index=k))


def _is_hf(dataset: Any) -> bool:
    return type(dataset).__module__.startswith("datasets.") and callable(getattr(dataset, "iter", None))


def hf_rows(dataset: Any) -> Iterator[Any]:
    """A `datasets` IterableDataset's rows, read whole: iterating it directly inside a
    DataLoader worker would make datasets split it once more among the workers."""
    for rows in dataset.iter(batch_size=256):
        for i in range(len(next(iter(rows.values())))):
            yield {key: column[i] for key, column in rows.items()}


def as_stream(dataset: Any, readers: int) -> Any:
    """A Hugging Face streaming set with at least as many shards as readers becomes a
    ShardedStream of its own shards (each read by one reader, positions resumable); with
    fewer, it stays a plain stream, dealt out round-robin (as datasets' split_dataset_by_node
    does then)."""
    count = getattr(dataset, "num_shards", None) or getattr(dataset, "n_shards", None)
    if _is_hf(dataset) and callable(getattr(dataset, "shard", None)) and count and count >= readers:
        return ShardedStream(list(range(count)), read=HfShard(dataset, count))
    return dataset


@dataclass(frozen=True)
class Reader:
    """One reader of a pass: rank `rank`'s worker `worker`, of `world` ranks x `workers`."""

    rank: int
    world: int
    worker: int = 0
    workers: int = 1

    @property
    def index(self) -> int:
        return self.rank * self.workers + self.worker

    @property
    def count(self) -> int:
        return self.world * self.workers


def shard_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed * 1_000_003 + epoch + 17)
    return torch.randperm(n, generator=g).tolist()


def my_shards(
    n: int, seed: int, epoch: int, shuffle: bool, reader: Reader, done: dict[int, int | None], same_deal: bool
) -> list[int]:
    """The shards this reader reads in this pass, in order. `done`: shard -> samples already
    taken from it (None: finished), from a checkpoint. `same_deal` (the checkpoint's world
    size and workers are this run's): each reader keeps its shards, in the same order;
    otherwise the unfinished shards are dealt out anew, partly read ones first."""
    order = shard_order(n, seed, epoch, shuffle)
    if not same_deal and done:
        rest = [s for s in order if done.get(s, 0) is not None]
        order = [s for s in rest if done.get(s)] + [s for s in rest if not done.get(s)]
    mine = [
        s
        for k, s in enumerate(order)
        if k % reader.world == reader.rank and (k // reader.world) % reader.workers == reader.worker
    ]
    return [s for s in mine if done.get(s, 0) is not None]


class StreamBatches(IterableDataset):
    """What one reader yields: (collated batch, its state after that batch). A DataLoader
    with batch_size=None runs it in each worker process; the rank keeps the newest state of
    each worker, from the batches it has taken (not the ones prefetched)."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        rank: int,
        world: int,
        seed: int,
        epoch: int,
        shuffle: bool,
        state: dict[str, Any],
        workers: int,
    ) -> None:
        self.dataset, self.batch_size, self.rank, self.world = dataset, batch_size, rank, world
        self.seed, self.epoch, self.shuffle, self.state, self.workers = seed, epoch, shuffle, state, workers

    def __iter__(self) -> Iterator[tuple[Any, dict[str, Any]]]:
        info = torch.utils.data.get_worker_info()
        workers = max(1, self.workers)
        # The DataLoader takes batches from its workers in turn, starting at worker 0; a resumed
        # pass must go on with the reader whose turn it was: worker p plays reader p + offset.
        offset = int(self.state.get("next_worker", 0)) if (self.state.get("workers") == self.workers) else 0
        reader = Reader(self.rank, self.world, ((info.id if info is not None else 0) + offset) % workers, workers)
        same_deal = (self.state.get("world"), self.state.get("workers")) == (self.world, self.workers)
        if isinstance(self.dataset, ShardedStream):
            items = self._sharded(reader, same_deal)
        else:
            items = self._round_robin(reader, same_deal)
        batch: list[Any] = []
        last: dict[str, Any] = {}
        for sample, last in items:
            batch.append(sample)
            if len(batch) == self.batch_size:
                yield _collate(batch), {**last, "worker": reader.worker}
                batch = []
        if batch:  # this reader's short last batch
            yield _collate(batch), {**last, "worker": reader.worker}

    def _sharded(self, reader: Reader, same_deal: bool) -> Iterator[tuple[Any, dict[str, Any]]]:
        ds: ShardedStream = self.dataset
        done = {int(k): v for k, v in self.state.get("shards", {}).items()}
        progress: dict[int, int | None] = {}  # this reader's shards: samples taken, None when finished
        for shard in my_shards(len(ds.shards), self.seed, self.epoch, self.shuffle, reader, done, same_deal):
            skip = done.get(shard) or 0
            taken = 0
            try:
                source = iter(ds.read(ds.shards[shard]))
                for sample in source:
                    taken += 1
                    if taken <= skip:
                        continue  # taken before the checkpoint
                    progress[shard] = taken
                    yield (ds.decode(sample) if ds.decode else sample), {"shards": dict(progress)}
            except OSError as e:
                raise DdpkitError(
                    f"cannot read shard {ds.shards[shard]!r}: {e.strerror or e}; check the shard list"
                ) from None
            progress[shard] = None

    def _round_robin(self, reader: Reader, same_deal: bool) -> Iterator[tuple[Any, dict[str, Any]]]:
        # items behind this reader: its own next index at the same world size and workers, else
        # the earliest any reader had reached (then up to readers x batch items may repeat)
        behind = {int(k): v for k, v in self.state.get("items", {}).items()}
        start = behind.get(reader.index, 0) if same_deal else min(behind.values(), default=0)
        for i, item in enumerate(hf_rows(self.dataset) if _is_hf(self.dataset) else self.dataset):
            if i < start or i % reader.count != reader.index:
                continue
            yield item, {"items": {reader.index: i + 1}}


def _collate(samples: list[Any]) -> Any:
    try:
        return default_collate(samples)
    except (TypeError, RuntimeError) as e:
        kind = type(samples[0]).__name__
        raise DdpkitError(
            f"the stream yielded {kind} items that cannot be batched ({str(e).splitlines()[0][:160]}); each item "
            "must be a sample: tensors, numbers, or a tuple/dict of them (decode raw records with decode=...)"
        ) from None


class StreamLoader(RankBatches):
    """This rank's batches of a stream for one pass at a time, with the state to resume.
    Mirrors ShardedLoader where the loop needs it; `n` and len() are None (no length)."""

    n = None

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        num_workers: int = 0,
        agree: Callable[[torch.Tensor], Any] | None = None,
        device: torch.device | str = "cpu",
        global_batch: int | None = None,
    ) -> None:
        """`global_batch`: samples per step of all ranks together; this rank then reads its
        share of it (the shares differ by at most one) instead of `batch_size`."""
        if global_batch is not None:
            base, extra = divmod(global_batch, world_size)
            batch_size = base + (1 if rank < extra else 0)
        self.fixed_global_batch = global_batch
        if batch_size < 1:
            raise ValueError("batch_size must be positive")
        self.agree = agree  # an in-place sum over all ranks (the runtime's collectives)
        self.device = torch.device(device)
        dataset = as_stream(dataset, world_size * max(1, num_workers))
        self.dataset, self.batch_size, self.rank, self.world_size = dataset, batch_size, rank, world_size
        self.seed, self.shuffle, self.num_workers = seed, shuffle, num_workers
        self.epoch = 0
        self.resume_state: dict[str, Any] = {}
        self.taken: dict[str, Any] = {}

    def __len__(self) -> int:
        raise TypeError("a stream has no length")

    def batches(self) -> Iterator[Any]:
        """This rank's batches of the current pass, from the resume state when there is one."""
        start = self.resume_state if self.resume_state.get("epoch") == self.epoch else {}
        self.taken = {
            "shards": dict(start.get("shards", {})),
            "items": dict(start.get("items", {})),
            "next_worker": start.get("next_worker", 0) if start.get("workers") == self.num_workers else 0,
        }
        source = StreamBatches(
            self.dataset,
            self.batch_size,
            self.rank,
            self.world_size,
            self.seed,
            self.epoch,
            self.shuffle,
            start,
            self.num_workers,
        )
        loader = DataLoader(source, batch_size=None, num_workers=self.num_workers) if self.num_workers else source
        for batch, state in loader:
            if first_tensor(batch) is None:
                raise DdpkitError(
                    f"the stream yielded {type(batch).__name__} batches that hold no tensor: each item must be a "
                    "sample (tensors, numbers, or a tuple/dict of them); decode raw records with decode=..."
                )
            self.taken["shards"].update(state.get("shards", {}))
            self.taken["items"].update(state.get("items", {}))
            self.taken["next_worker"] = (state["worker"] + 1) % max(1, self.num_workers)
            yield batch

    def iter_steps(self) -> Iterator[tuple[Any, int, int]]:
        """(batch, local samples, global samples) per step, while every rank has a batch: the
        ranks agree before each step (one small all-reduce), so the pass ends on all of them at
        the first step where one has run out; what the others still had is dropped. A loaded
        state continues from its position in the shards."""
        source = self.batches()
        while True:
            batch = next(source, None)
            n = sample_count(batch) if batch is not None else 0
            flags = torch.tensor([0.0 if batch is not None else 1.0, float(n)], dtype=torch.float64, device=self.device)
            if self.agree is not None and self.world_size > 1:
                self.agree(flags)
            missing, total = flags.tolist()
            if missing:
                return
            yield batch, n, int(total)

    def __iter__(self) -> Iterator[Any]:
        for batch, _, _ in self.iter_steps():
            yield batch

    def state(self) -> dict[str, Any]:
        """This rank's position in the pass (what it has taken, not what workers prefetched)."""
        return {
            "epoch": self.epoch,
            "world": self.world_size,
            "workers": self.num_workers,
            "shards": dict(self.taken.get("shards", {})),
            "items": dict(self.taken.get("items", {})),
            "next_worker": self.taken.get("next_worker", 0),
        }

    def load(self, states: list[dict[str, Any]]) -> None:
        """Every rank's saved state: together, what every reader had taken (and, at the same
        world size, whose turn it is on this rank)."""
        shards: dict[int, int | None] = {}
        items: dict[int, int] = {}
        for s in states:
            for k, v in s.get("shards", {}).items():
                k = int(k)
                shards[k] = None if v is None or shards.get(k, 0) is None else max(shards.get(k, 0), v)
            for k, v in s.get("items", {}).items():
                items[int(k)] = max(items.get(int(k), 0), v)
        first = states[0] if states else {}
        mine = states[self.rank] if len(states) == self.world_size else {}
        self.resume_state = {
            "epoch": first.get("epoch", 0),
            "world": first.get("world"),
            "workers": first.get("workers"),
            "shards": shards,
            "items": items,
            "next_worker": mine.get("next_worker", 0),
        }
