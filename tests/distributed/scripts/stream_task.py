"""Streaming tasks for the tests: samples with ids, read from .jsonl shards (ShardedStream) or
from a plain IterableDataset. The model writes the ids it trains on, one line per step, to
RUN_DIR/ids-rank{R}.txt, so the tests can count which samples every rank saw."""
import json
import os
from pathlib import Path

import torch
from torch import nn

import ddpkit


def write_shards(folder, shards: int, per_shard, start: int = 0):
    """Shard files of samples {"id", "x": 4 floats, "y": class}; per_shard: an int or a list."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sizes = per_shard if isinstance(per_shard, list) else [per_shard] * shards
    g = torch.Generator().manual_seed(5)
    paths, i = [], start
    for s, n in enumerate(sizes):
        lines = []
        for _ in range(n):
            x = torch.randn(4, generator=g)
            lines.append(json.dumps({"id": i, "x": x.tolist(), "y": int(x.sum() > 0)}))
            i += 1
        path = folder / f"shard-{s:03d}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        paths.append(str(path))
    return paths


def decode(record):
    return {"x": torch.tensor(record["x"]), "y": torch.tensor(record["y"]), "id": torch.tensor(record["id"])}


class IdModel(nn.Module):
    """A classifier that logs the ids of every batch it trains on."""

    def __init__(self, log: Path | None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.log = log

    def forward(self, x, y, id):
        if self.training and self.log is not None and len(id):
            with open(self.log, "a") as f:
                f.write(" ".join(str(i) for i in id.tolist()) + "\n")
        logits = self.net(x)
        return {"logits": logits, "loss": nn.functional.cross_entropy(logits, y)}


class Counting(torch.utils.data.IterableDataset):
    """A plain IterableDataset (no shards): ddpkit deals its items out round-robin."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        g = torch.Generator().manual_seed(9)
        for i in range(self.n):
            x = torch.randn(4, generator=g)
            yield {"x": x, "y": torch.tensor(int(x.sum() > 0)), "id": torch.tensor(i)}


def _log(config):
    rank = int(os.environ.get("RANK", "0"))
    return Path(config.run_dir) / f"ids-rank{rank}.txt" if config is not None and config.run_dir else None


def hf_stream(n: int, shards: int):
    """A Hugging Face `datasets` streaming set of n samples in `shards` shards, made in memory."""
    import datasets

    g = torch.Generator().manual_seed(9)
    x = torch.randn(n, 4, generator=g)
    table = {"x": x.tolist(), "y": (x.sum(1) > 0).long().tolist(), "id": list(range(n))}
    return datasets.Dataset.from_dict(table).to_iterable_dataset(num_shards=shards).with_format("torch")


def build(config=None, shards_dir: str = "", plain: int = 0, bad: str = "", hf: int = 0, hf_shards: int = 6):
    if hf:
        train = hf_stream(hf, hf_shards)
    elif plain:
        train = Counting(plain)
    else:
        paths = sorted(str(p) for p in Path(shards_dir).glob("*.jsonl")) if shards_dir else []
        if bad == "missing":
            paths.append(str(Path(shards_dir) / "gone.jsonl"))
        train = ddpkit.ShardedStream(paths, decode=(lambda r: r["id"]) if bad == "not-a-sample" else decode)
        if bad == "strings":
            train = ddpkit.ShardedStream(paths, decode=lambda r: "text")
    return ddpkit.Task(model=IdModel(_log(config)), train_set=train,
                       optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
