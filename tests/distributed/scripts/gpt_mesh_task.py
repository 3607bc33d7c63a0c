"""examples/gpt.py's GPT with separate q/k/v projections and its own head (qkv=separate, tie=False:
what --tp splits by heads and --pp cuts into stages), float64, SGD, on (characters, next
characters) windows of its text scored by a cross-entropy loss_fn: one task that every mesh of
tests/distributed/test_gpt_meshes.py trains, with examples/gpt.py's own tp_plan."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit

_spec = importlib.util.spec_from_file_location(
    "gpt_example", Path(__file__).resolve().parents[3] / "examples" / "gpt.py"
)
gpt = sys.modules.setdefault("gpt_example", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(gpt)


class NextCharacters(gpt.GPT):
    """The logits alone: the loss is the task's loss_fn, which the pipeline's last stage applies."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx)[0]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build(samples: int = 36, block_size: int = 16) -> ddpkit.Task:
    train, held, vocab = gpt.char_data(block_size, samples)  # 36 windows to train on, 9 held out
    torch.manual_seed(0)
    config = gpt.GPTConfig(len(vocab), block_size, n_layer=2, n_head=4, n_embd=32, qkv="separate", tie=False)
    return ddpkit.Task(
        model=NextCharacters(config).double(),
        train_set=TensorDataset(train.x, train.y),
        eval_set=TensorDataset(held.x, held.y),  # 9: uneven over 2 data-parallel ranks, each counted once
        loss_fn=loss_fn,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
        tp_plan=gpt.tp_plan("separate"),
    )
