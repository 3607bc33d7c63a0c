"""The benchmark's bigger workload: a 9.46M-parameter MLP on synthetic data.

Used by two sides, so that the comparison is exact:
  * ddpkit:      ddpkit train benchmarks/tasks/mlp.py:build --nproc 2 --epochs 1 ...
  * baselines:   benchmarks/baselines/{handwritten_ddp,accelerate_wine,fabric_wine}.py
                 --workload mlp  (they import make_model / make_data from this file)

Model 512-2048-2048-2048-10 (9,463,818 parameters), fixed-seed random inputs and labels,
SGD(lr=0.01, no momentum): the cheapest optimizer step, so the measurement is about
forward/backward/all-reduce rather than optimizer arithmetic (Adam would add ~3 fp32
passes over 9.46M parameters per step).

Data set size: BENCH_MLP_SAMPLES (env) or 15360 = 30 steps x 2 processes x batch 256,
so one epoch at --nproc 2 / batch 256 per process is the same 30 steps the hand-written
loop runs (the baselines report samples/s over the whole epoch, as ddpkit does, and also
"steady" samples/s over steps 6..30, after 5 warm-up steps).
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.utils.data import TensorDataset

IN_FEATURES = 512
HIDDEN = 2048
CLASSES = 10
BATCH_PER_PROCESS = 256
LR = 0.01
DEFAULT_SAMPLES = 30 * 2 * BATCH_PER_PROCESS  # 15360
DATA_SEED = 1234
MODEL_SEED = 0


def default_samples() -> int:
    return int(os.environ.get("BENCH_MLP_SAMPLES", DEFAULT_SAMPLES))


def make_model() -> nn.Module:
    """The MLP, initialised from MODEL_SEED without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MODEL_SEED)
        return nn.Sequential(
            nn.Linear(IN_FEATURES, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, CLASSES),
        )


def make_data(samples: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed-seed random float32 inputs (samples x 512) and int64 labels in [0, 10)."""
    n = default_samples() if samples is None else int(samples)
    g = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(n, IN_FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return x, y


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR)


def build(*_args, samples: int | None = None, **_kwargs) -> dict:
    """ddpkit task entry point (extra positional/keyword arguments are ignored)."""
    model = make_model()
    x, y = make_data(samples)
    return {
        "model": model,
        "train_set": TensorDataset(x, y),
        "optimizer": make_optimizer(model),
        "loss_fn": nn.CrossEntropyLoss(),
    }


def build_momentum(*_args, **_kwargs) -> dict:
    """The same workload with SGD momentum: a checkpoint then holds one state tensor per
    parameter as well (benchmarks/checkpoint_save.py)."""
    task = build()
    task["optimizer"] = torch.optim.SGD(task["model"].parameters(), lr=LR, momentum=0.9)
    return task


if __name__ == "__main__":
    t = build()
    print(sum(p.numel() for p in t["model"].parameters()), "parameters,", len(t["train_set"]), "samples")
