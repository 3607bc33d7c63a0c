"""A map-style task whose items take `delay` seconds each to load on one rank only: that
rank is the slow one, and the time goes to waiting for data."""
import os
import time

import torch
from torch import nn

import ddpkit


class Items(torch.utils.data.Dataset):
    def __init__(self, n: int, slow_rank: int, delay: float):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 4, generator=g)
        self.y = (self.x.sum(1) > 0).long()
        self.slow = int(os.environ.get("RANK", "0")) == slow_rank
        self.delay = delay

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.slow:
            time.sleep(self.delay)
        return self.x[i], self.y[i]


def build(slow_rank: int = 1, delay: float = 0.01, n: int = 160):
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    data = Items(n, slow_rank, delay)
    return ddpkit.Task(model=model, train_set=data, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
