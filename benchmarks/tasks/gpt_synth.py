"""The GPT benchmark's workload (benchmarks/gpt_mfu.py): examples/gpt.py's model at GPT-2
small's shape, on synthetic tokens (nothing downloaded).

Used by both sides, so that the comparison is exact:
  * ddpkit:  ddpkit train benchmarks/tasks/gpt_synth.py:build --nproc 1 --clip-grad-norm 1.0 ...
  * by hand: benchmarks/baselines/handwritten_gpt_mfu.py (imports make_model, make_data, make_optimizer)

Defaults: 12 layers x 768 wide, 12 heads, sequence 1024, vocabulary 50,304 (GPT-2's 50,257
rounded up to a multiple of 64): 124M parameters. The data: `samples` windows of one
fixed-seed stream of uniformly random token ids (targets: the same stream shifted by one),
items {"idx", "targets"} as the example's. AdamW (weight decay on the matrices only, lr
6e-4, betas 0.9/0.95), no schedule; the caller clips the gradient norm at 1.0. Every size is
a task argument (`--task-arg n_layer=2`), so the same workload runs tiny on a CPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt  # noqa: E402  (examples/gpt.py)

DATA_SEED = 1234
LR = 6e-4


def make_model(n_layer: int, n_head: int, n_embd: int, block_size: int, vocab_size: int) -> gpt.GPT:
    return gpt.GPT(gpt.GPTConfig(vocab_size, block_size, n_layer, n_head, n_embd, 0.0))


def make_data(samples: int, block_size: int, vocab_size: int) -> gpt.CharWindows:
    g = torch.Generator().manual_seed(DATA_SEED)
    ids = torch.randint(vocab_size, (samples * block_size + 1,), generator=g)
    return gpt.CharWindows(ids, block_size)


def make_optimizer(params, fused: bool = False) -> torch.optim.AdamW:
    """The example's AdamW (gpt.adamw_with_decay_groups: decay 0.1 on the matrices only);
    `fused`: one kernel over all parameters, as ddpkit's --fused-optimizer on rebuilds it."""
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), fused=True if fused else None)


def build(
    config=None,
    *,
    n_layer: int = 12,
    n_head: int = 12,
    n_embd: int = 768,
    block_size: int = 1024,
    vocab_size: int = 50304,
    samples: int = 320,
):
    import ddpkit

    return ddpkit.Task(
        model=make_model(n_layer, n_head, n_embd, block_size, vocab_size),
        train_set=make_data(samples, block_size, vocab_size),
        optimizer=lambda params: gpt.adamw_with_decay_groups(params, lr=LR),
    )
