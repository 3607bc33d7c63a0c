"""What the memory plan cannot count from the parameters: the activations a batch keeps for
backward. One forward of the task's first samples, as the loop runs it (the same batches and
loss), counted by what autograd saves (strategies/activation.py: SavedBytes), at 1 and at 2
samples; a batch of B keeps f(1) + (B - 1) * (f(2) - f(1)): the part every sample adds, and
what does not grow with the batch (position embeddings, a mask). Exact where activations are
linear in the batch, as a transformer's are; measured on this machine's CPU at the run's
precision: under autocast for bf16 and fp16 (fp16 probed as bf16, two bytes alike, as CPU
autocast runs it), where matmuls keep half-size inputs and the loss its fp32 copy."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils.data import IterableDataset, default_collate

from ..strategies.activation import SavedBytes
from ..strategies.memory import ActivationEstimate
from ..strategies.precision import autocast
from ..task import Task
from .batches import compute_loss

# the autocast dtype of the probe's forward at each --precision (none: fp32)
HALF = {"bf16": torch.bfloat16, "fp16": torch.bfloat16}


def estimate_activations(
    task: Task, batch_size: int, blocks: Callable[[nn.Module], Iterable[nn.Module]], precision: str = "fp32"
) -> ActivationEstimate | str:
    """The estimate per rank at `batch_size` samples per micro-batch and `precision` (fp32,
    bf16, fp16), with and without checkpointing on `blocks(model)`; or why there is none."""
    if any(p.is_meta for p in task.model.parameters()):
        return "the model is on the meta device (shapes without memory)"
    samples = _first(task.train_set, 2)
    if len(samples) < 2:
        return "the training set has fewer than 2 samples"
    chosen = list(blocks(task.model))
    counted = []
    was_training = task.model.training
    task.model.train()
    try:
        for n in (1, 2):
            with torch.enable_grad(), autocast("cpu", HALF.get(precision)), SavedBytes(blocks=chosen) as saved:
                compute_loss(task.model, default_collate(samples[:n]), n, task.loss_fn, task.step, torch.device("cpu"))
            counted.append(saved)
    except Exception as e:  # the plan still stands without it (a model that needs a GPU, say)
        return f"one forward on the CPU failed: {type(e).__name__}: {e}"
    finally:
        task.model.train(was_training)

    def at_batch(f: Callable[[SavedBytes], int]) -> int:
        one, two = (f(c) for c in counted)
        return max(0, one + (batch_size - 1) * (two - one))

    return ActivationEstimate(
        batch_size=batch_size,
        kept=at_batch(lambda c: c.kept(False)),
        kept_checkpointed=at_batch(lambda c: c.kept(True)) if chosen else None,
        recomputed=at_batch(lambda c: c.recomputed()) if chosen else 0,
        precision=precision,
    )


def _first(dataset: Any, n: int) -> list[Any]:
    if isinstance(dataset, IterableDataset):
        return list(itertools.islice(iter(dataset), n))
    return [dataset[i] for i in range(min(n, len(dataset)))]
