"""Wine with one thing that `ddpkit verify` must name (selected by function):

- with_dropout: a correct model with nn.Dropout (verify turns it off: exact, exit 0);
- with_batchnorm: BatchNorm1d at the input (its running statistics drift first);
- divided_by_world: the loss divided by the world size by hand, as if DDP did not average
  (accumulation is exact, 2 processes are not: a per-process reduction);
- forgets_state: an optimizer that decays its learning rate by a count it keeps outside its
  state_dict (only the resumed run drifts: state missing from the checkpoint);
- noisy_inputs: Gaussian noise on the inputs in the forward (randomness beyond nn.Dropout)."""

import os

import torch
from torch import nn

from ddpkit.tasks.wine import build as wine


def with_dropout(config=None):
    task = wine(config)
    task.model = nn.Sequential(nn.Dropout(0.3), task.model)
    return task


def with_batchnorm(config=None):
    task = wine(config)
    task.model = nn.Sequential(nn.BatchNorm1d(13), task.model)
    return task


def divided_by_world(config=None):
    task = wine(config)
    loss = task.loss_fn
    world = int(os.environ.get("WORLD_SIZE", "1"))  # 1 for a run of one process (no process group)
    task.loss_fn = lambda out, y: loss(out, y) / world
    return task


class DecayingSGD(torch.optim.SGD):
    """Halves its learning rate at every step by a count it keeps as a plain attribute."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.base, self.count = lr, 0

    def step(self, closure=None):
        self.count += 1
        for group in self.param_groups:
            group["lr"] = self.base * 0.5**self.count
        return super().step(closure)


def forgets_state(config=None):
    task = wine(config)
    task.optimizer = lambda params: DecayingSGD(params, lr=0.5)
    return task


class Noisy(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x + 0.1 * torch.randn_like(x) if self.training else x)


def noisy_inputs(config=None):
    task = wine(config)
    task.model = Noisy(task.model)
    return task
