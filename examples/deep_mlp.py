"""A deeper model for --strategy fsdp: residual MLP blocks in an nn.ModuleList, the shape
FSDP's default policy shards block by block (like a transformer's layers).

    ddpkit train examples/deep_mlp.py:build --strategy fsdp --nproc 2 --epochs 5
    ddpkit plan examples/deep_mlp.py:large --nproc 8 --device-memory 80GB
    ddpkit train examples/deep_mlp.py:large --strategy fsdp --nproc 8 --epochs 1
    ddpkit train examples/deep_mlp.py:large --strategy fsdp --nproc 2 --task-arg width=256 --epochs 1
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class DeepMLP(nn.Module):
    def __init__(self, features: int, width: int, depth: int, classes: int) -> None:
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(config=None, width: int = 64, depth: int = 6, samples: int = 512) -> ddpkit.Task:
    g = torch.Generator().manual_seed(1234)  # the same data on every rank
    x = torch.randn(samples, 32, generator=g)
    w = torch.randn(32, 4, generator=g)
    y = (x @ w).argmax(dim=1)
    split = samples * 3 // 4
    return ddpkit.Task(
        model=DeepMLP(32, width, depth, 4),
        train_set=TensorDataset(x[:split], y[:split]),
        eval_set=TensorDataset(x[split:], y[split:]),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01),
    )


def large(config=None, width: int = 8192, depth: int = 12) -> ddpkit.Task:
    """6.4 billion parameters (width 8192, 12 blocks), built on the meta device: shapes
    without memory. `ddpkit plan` sizes it; under `--strategy fsdp` each rank materialises
    only its shards, block by block, initialised by the layers' own reset_parameters()
    (the same weights as an eager build under the same seed), so no rank ever holds the
    whole 25.8 GB model. Smaller widths (--task-arg width=256) train on a laptop."""
    with torch.device("meta"):
        model = DeepMLP(32, width, depth, 4)
    task = build(config, width=1, depth=1, samples=64)
    task.model = model
    return task
