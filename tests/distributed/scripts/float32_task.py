"""An exact task that refuses float64: its forward casts the input to float32 itself, so a
model cast to float64 meets a float32 input in its first layer and fails. `ddpkit verify`
must fall back to float32 and say so."""
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


class Float32Only(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x):
        return self.body(x.to(torch.float32))


def build(config=None):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 6, generator=g)
    y = torch.randint(0, 3, (40,), generator=g)
    return ddpkit.Task(
        model=Float32Only(),
        train_set=TensorDataset(x, y),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )
