"""Wine in float64 with SGD and momentum, for the node-loss tests: a resumed run must give the
uninterrupted run's model; in float64 another summation order (4 ranks, then 2) changes it by
~1e-15, so only a wrong sample, batch or optimizer state could move it by 1e-5. The momentum
buffers make a lost optimizer state visible."""

import dataclasses

import torch
from torch.utils.data import TensorDataset

from ddpkit.tasks.wine import build as wine


def build(config=None):
    task = wine(config)
    x, y = task.train_set.tensors
    ex, ey = task.eval_set.tensors
    return dataclasses.replace(
        task,
        model=task.model.double(),
        train_set=TensorDataset(x.double(), y),
        eval_set=TensorDataset(ex.double(), ey),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
    )
