"""Batches of any structure, and the loss of one micro-batch.

A batch is what the data set's items collate to:
  * a dict (what a tokenised Hugging Face data set gives): the model is called as
    `model(**batch)`;
  * a tuple or list: the `(inputs..., target)` rule, `model(*inputs)` and
    `loss_fn(output, target)`;
  * anything nested: moved to the device and cut into micro-batches whole (every tensor
    along its first dimension, other values kept as they are).
The number of samples is the first tensor's length.

The loss, in this order: the task's `step(model, batch)` hook; the task's `loss_fn`; the loss
the model's output carries (an attribute or key `loss`, or a `(logits, loss)` tuple, as
Hugging Face and nanoGPT models return); cross-entropy of `(inputs..., target)` items.
A `step` that returns `(loss_sum, count)` makes the loss exact over tokens: ddpkit divides
by the count over every micro-batch and rank, so padding cannot make world sizes differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..data.samples import first_tensor, sample_count  # noqa: F401  (re-exported for the loop)
from ..errors import DdpkitError
from ..util.tree import map_tensors

_CROSS_ENTROPY = nn.CrossEntropyLoss()


@dataclass
class Loss:
    """One micro-batch's loss: `value` to backward, and how it is normalised."""

    value: torch.Tensor | None  # None: no sample in this micro-batch
    count: torch.Tensor  # samples (mean losses) or the step hook's count (summed losses), float64
    summed: bool  # value is a sum over `count` items (else a mean over the samples)
    output: Any = None


def zero_loss(out: Any) -> torch.Tensor:
    """0 x the model's output, for a rank with no sample in a short last batch: its backward
    joins the gradient sync with zeros. Not from a carried loss: the mean of nothing is NaN."""
    if isinstance(out, dict):
        out = {k: v for k, v in out.items() if k != "loss"}
    elif carried_loss(out) is not None and isinstance(out, tuple):
        out = out[0]
    t = first_tensor(out)
    if t is None:
        raise DdpkitError("the model's output holds no tensor to join the gradient sync with")
    return t.sum() * 0.0


def to_device(batch: Any, device: torch.device) -> Any:
    """The batch with every tensor on `device` (the same object on the CPU)."""
    if device.type == "cpu":
        return batch
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


def split(batch: Any, sizes: list[int]) -> list[Any]:
    """The batch cut into consecutive micro-batches of `sizes` samples each."""
    if isinstance(batch, torch.Tensor):
        return list(torch.split(batch, sizes))
    if isinstance(batch, dict):
        parts = {k: split(v, sizes) for k, v in batch.items()}
        return [{k: parts[k][i] for k in batch} for i in range(len(sizes))]
    if isinstance(batch, (list, tuple)):
        cols = [split(v, sizes) for v in batch]
        return [tuple(c[i] for c in cols) for i in range(len(sizes))]
    return [batch] * len(sizes)  # a non-tensor value (a flag, a string) goes to every micro-batch


def compute_loss(
    model: nn.Module, batch: Any, n: int, loss_fn: Callable | None, step: Callable | None, device: torch.device
) -> Loss:
    """Forward one micro-batch of `n` samples and take its loss (see the module docstring)."""
    if step is not None:
        result = step(model, batch)
        if isinstance(result, (tuple, list)):
            if len(result) != 2:
                raise DdpkitError("the task's step(model, batch) must return the loss, or (loss_sum, count)")
            total, count = result
            return Loss(
                _scalar(total, "step(model, batch)'s loss_sum") if n else None,
                _as_count(count, device),
                True,
                total,
            )
        return Loss(_scalar(result, "step(model, batch)") if n else None, _count(n, device), False, result)
    if isinstance(batch, dict):
        out = model(**batch)
        if loss_fn is not None:
            return Loss(loss_fn(out, batch) if n else None, _count(n, device), False, out)
        return Loss(own_loss(out, "a dict batch") if n else None, _count(n, device), False, out)
    if not isinstance(batch, (list, tuple)) or len(batch) < 2:
        raise DdpkitError(
            "each item of the training set must be a dict (passed to the model as keyword arguments) "
            f"or (inputs..., target); got {type(batch).__name__}"
        )
    *inputs, target = batch
    out = model(*inputs)
    if loss_fn is not None:
        return Loss(loss_fn(out, target) if n else None, _count(n, device), False, out)
    carried = carried_loss(out)
    if carried is not None:
        return Loss(carried if n else None, _count(n, device), False, out)
    return Loss(_CROSS_ENTROPY(out, target) if n else None, _count(n, device), False, out)


def carried_loss(out: Any) -> torch.Tensor | None:
    """The loss a model's output carries: `.loss`, `["loss"]`, or the second of `(logits, loss)`."""
    loss = getattr(out, "loss", None) if not isinstance(out, dict) else out.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor) and out[1].dim() == 0:
        return out[1]
    return None


def own_loss(out: Any, what: str) -> torch.Tensor:
    loss = carried_loss(out)
    if loss is None:
        raise DdpkitError(
            f"the model's output for {what} carries no loss (an attribute or key 'loss', or (logits, loss)); "
            "give the task a loss_fn(output, batch) or a step(model, batch) that returns the loss"
        )
    return loss


def _scalar(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise DdpkitError(f"the task's {what} must return a scalar tensor, got {type(value).__name__}")
    return value.reshape(())


def _count(n: int, device: torch.device) -> torch.Tensor:
    """Filled on the device, not copied from the host (a copy from pageable memory waits for the GPU)."""
    return torch.full((), float(n), dtype=torch.float64, device=device)


def _as_count(count: Any, device: torch.device) -> torch.Tensor:
    if isinstance(count, torch.Tensor):
        return count.to(device=device, dtype=torch.float64, non_blocking=True).reshape(())
    return _count(count, device)
