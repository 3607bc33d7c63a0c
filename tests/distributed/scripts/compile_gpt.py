"""examples/gpt.py at a tiny width (2 blocks of 16 channels, 64 windows of 16 characters)
trained by plain SGD without a schedule: a few steps of it keep float32 rounding from growing,
so a compiled run and the eager one end within rounding of each other (test_compile_fsdp.py)."""

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import gpt  # noqa: E402


def build(config=None):
    task = gpt.build(config, n_layer=2, n_head=2, n_embd=16, block_size=16, max_samples=64)
    return dataclasses.replace(task, optimizer=lambda params: torch.optim.SGD(params, lr=0.5), scheduler=None)
