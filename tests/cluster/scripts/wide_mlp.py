"""A task whose gradients are big enough (137k float32: 0.55 MB a step) that a throttled link
slows every step's gradient sync, and whose compute stays small (one hidden layer)."""

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


def build(n: int = 320):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 64, generator=g)
    model = nn.Sequential(nn.Linear(64, 2048), nn.Tanh(), nn.Linear(2048, 2))
    data = TensorDataset(x, (x.sum(1) > 0).long())
    return ddpkit.Task(model=model, train_set=data, optimizer=lambda p: torch.optim.SGD(p, lr=0.05))
