"""A tiny model over a long epoch, to measure what a resume costs at step 10 and at step
10,000 (benchmarks/resume_cost.py): a map-style set of 200,000 samples, or a stream of 64
synthetic shards of 4,000 samples (no files: the reading is not what is measured)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

SAMPLES = 200_000
SHARDS, PER_SHARD = 64, 4_000


def _shard(k: int):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(PER_SHARD, 8, generator=g)
    y = (x.sum(1) > 0).long()
    for i in range(PER_SHARD):
        yield x[i], y[i]


def build(kind: str = "map"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    if kind == "stream":
        data = ddpkit.ShardedStream(list(range(SHARDS)), read=_shard)
    else:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(SAMPLES, 8, generator=g)
        data = TensorDataset(x, (x.sum(1) > 0).long())
    return ddpkit.Task(model=model, train_set=data, optimizer=lambda p: torch.optim.SGD(p, lr=0.05))
