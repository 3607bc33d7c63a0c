"""Tasks of the Ray tests (tests/distributed/test_ray.py): Wine in float64 trained by plain SGD
(the same numbers whoever runs it, summation order aside); the same with a worker that kills
its own process once, mid-run; one whose task raises on rank 1 only."""

import os
import signal
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddpkit.tasks.wine import build as wine


class KilledOnce(nn.Module):
    """Wraps a model; rank 1's process is SIGKILLed at its `at`-th forward, once (the `marker`
    file says it happened): a worker dying from outside, as far as Ray can tell."""

    def __init__(self, inner, at, marker):
        super().__init__()
        self.inner = inner
        self.at = at
        self.marker = Path(marker)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at and os.environ.get("RANK") == "1" and not self.marker.exists():
            self.marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner(x)

    def state_dict(self, *args, **kwargs):  # the keys of the plain Wine model
        return self.inner.state_dict(*args, **kwargs)

    def load_state_dict(self, state, *args, **kwargs):
        return self.inner.load_state_dict(state, *args, **kwargs)


def sgd(config=None, kill_at=0, marker=""):
    task = wine(config)
    task.model = task.model.double()
    for name in ("train_set", "eval_set"):
        x, y = getattr(task, name).tensors
        setattr(task, name, TensorDataset(x.double(), y))
    task.optimizer = lambda params: torch.optim.SGD(params, lr=0.05)
    if kill_at:
        task.model = KilledOnce(task.model, int(kill_at), marker)
    return task


def raises(config=None):
    """Rank 1's task fails, rank 0's does not: the rank that failed is the one named."""
    if os.environ.get("RANK") == "1":
        print("rank 1 looks for its data", flush=True)
        raise ValueError("the data set at /data/wine is missing")
    return wine(config)
