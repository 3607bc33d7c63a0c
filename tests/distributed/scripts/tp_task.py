"""A ddpkit task of the two-block GPT of test_tensor_parallel_plan.py (separate q/k/v), float64,
SGD, with its tensor-parallel plan: what `--tp 2` must train as one process does."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from ddpkit import Task

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "strategies"))
from test_tensor_parallel_plan import PLAN, Gpt  # noqa: E402


def build(samples: int = 16, momentum: float = 0.0) -> Task:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 6, 32, generator=g, dtype=torch.float64)
    y = torch.randn(samples, 6, 32, generator=g, dtype=torch.float64)
    torch.manual_seed(0)
    return Task(
        model=Gpt().double(),
        train_set=TensorDataset(x, y),
        eval_set=TensorDataset(x[:10], y[:10]),  # 10 samples: 2 dp ranks must count each once
        loss_fn=torch.nn.functional.mse_loss,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.2, momentum=momentum),
        metric=None,
        tp_plan=PLAN,
    )
