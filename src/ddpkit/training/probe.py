"""What the memory plan cannot count from the parameters: the activations a batch keeps for
backward. One forward of the task's first samples, as the loop runs it (the same batches and
loss), counted by what autograd saves (strategies/activation.py: SavedBytes), at 1 and at 2
samples; a batch of B keeps f(1) + (B - 1) * (f(2) - f(1)): the part every sample adds, and
what does not grow with the batch (position embeddings, a mask). Exact where activations are
linear in the batch, as a transformer's are; measured on this machine's CPU at the run's
precision: under autocast for bf16 and fp16 (fp16 probed as bf16, two bytes alike, as CPU
autocast runs it), where matmuls keep half-size inputs and the loss its fp32 copy; and, for
FSDP's mixed precision, with the model itself in half precision."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
from copy import deepcopy
from typing import Any, Callable, ContextManager, Iterable

import torch
from torch import nn
from torch.utils.data import IterableDataset, default_collate

from ..planning.peak import ActivationEstimate
from ..strategies.activation import SavedBytes
from ..strategies.precision import autocast
from ..task import Task
from .batches import compute_loss

# the autocast dtype of the probe's forward at each --precision (none: fp32)
HALF = {"bf16": torch.bfloat16, "fp16": torch.bfloat16}


def estimate_activations(
    task: Task, batch_size: int, blocks: Callable[[nn.Module], Iterable[nn.Module]], precision: str = "fp32"
) -> ActivationEstimate | str:
    """The estimate per rank at `batch_size` samples per micro-batch and `precision` (fp32,
    bf16, fp16), with and without checkpointing on `blocks(model)`; or why there is none.
    In bf16 and fp16 twice: under autocast (DDP) and with the model cast to half precision
    (FSDP's mixed precision, which casts each unit's parameters and floating inputs): its
    `sharded`."""
    samples = _first(task.train_set, 2)
    if len(samples) < 2:
        return "the training set has fewer than 2 samples"
    model, device = _probe_model(task.model, precision)
    samples = _moved(samples, device)
    half = HALF.get(precision)
    try:
        if device.type == "meta" and half is not None:  # autocast has no meta kernels: the cast model for both
            cast = model.to(half)
            estimate = _probe(task, cast, _cast(samples, half), batch_size, blocks, precision, contextlib.nullcontext())
            return dataclasses.replace(estimate, on_meta=True, sharded=estimate)
        estimate = _probe(task, model, samples, batch_size, blocks, precision, autocast(device.type, half))
        estimate = dataclasses.replace(estimate, on_meta=device.type == "meta")
        if half is None:
            return estimate
        cast = deepcopy(model).to(half)
        sharded = _probe(task, cast, _cast(samples, half), batch_size, blocks, precision, contextlib.nullcontext())
    except Exception as e:  # the plan still stands without it (a model that needs a GPU, say)
        return f"one forward on the CPU failed: {type(e).__name__}: {e}"
    finally:
        gc.collect()  # the probe's graphs hold cycles: free them now, not at some later collection
    return dataclasses.replace(estimate, sharded=sharded)


def _probe(
    task: Task,
    model: nn.Module,
    samples: list[Any],
    batch_size: int,
    blocks: Callable[[nn.Module], Iterable[nn.Module]],
    precision: str,
    context: ContextManager[Any],
) -> ActivationEstimate:
    """One forward at 1 and at 2 samples, under `context`, counted; the figures at `batch_size`."""
    chosen = list(blocks(model))
    counted = []
    was_training = model.training
    model.train()
    try:
        for n in (1, 2):
            with torch.enable_grad(), context, SavedBytes(blocks=chosen) as saved:
                compute_loss(model, default_collate(samples[:n]), n, task.loss_fn, task.step, _device(model))
            counted.append(saved)
    finally:
        model.train(was_training)

    def at_batch(f: Callable[[SavedBytes], int]) -> int:
        one, two = (f(c) for c in counted)
        return max(0, one + (batch_size - 1) * (two - one))

    def per_sample(f: Callable[[SavedBytes], int]) -> int:
        one, two = (f(c) for c in counted)
        return max(0, two - one)

    figures = (lambda c: c.kept(False), lambda c: c.kept(True), lambda c: c.recomputed())
    return ActivationEstimate(
        batch_size=batch_size,
        kept=at_batch(figures[0]),
        kept_checkpointed=at_batch(figures[1]) if chosen else None,
        recomputed=at_batch(figures[2]) if chosen else 0,
        precision=precision,
        per_sample=(
            per_sample(figures[0]),
            per_sample(figures[1]) if chosen else 0,
            per_sample(figures[2]) if chosen else 0,
        ),
    )


def _cast(samples: list[Any], dtype: torch.dtype) -> list[Any]:
    """The samples with their floating tensors in `dtype` (as FSDP casts a unit's inputs)."""
    from torch.utils._pytree import tree_map

    return [tree_map(lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t, s) for s in samples]


# a model built on the meta device is probed on a copy in memory up to this size: its tensors
# left as allocated (never written: untouched pages read as zeros and hold no memory), since on
# the meta device attention takes its math path and saves what the CPU's and GPU's fused kernels
# do not (+15% on the GPT example); a larger model on the meta device (shapes only)
REAL_PROBE_MAX = 1 << 30


def _probe_model(model: nn.Module, precision: str) -> tuple[nn.Module, torch.device]:
    """What the probe runs, and where: `model` itself on the CPU; for a model on the meta
    device a copy (the task's own model is left as it is), in memory when it is small enough,
    else on the meta device. `precision`: the run's (kept for the choice's record)."""
    params = list(model.parameters())
    if not any(p.is_meta for p in params):
        return model, torch.device("cpu")
    if sum(p.numel() * p.element_size() for p in params) > REAL_PROBE_MAX:
        return deepcopy(model).to("meta"), torch.device("meta")
    return deepcopy(model).to_empty(device="cpu"), torch.device("cpu")


def _device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _moved(samples: list[Any], device: torch.device) -> list[Any]:
    """The samples' tensors on `device` (the meta device: shapes only)."""
    if device.type == "cpu":
        return samples
    from torch.utils._pytree import tree_map

    return [tree_map(lambda t: t.to(device) if torch.is_tensor(t) else t, s) for s in samples]


def _first(dataset: Any, n: int) -> list[Any]:
    if isinstance(dataset, IterableDataset):
        return list(itertools.islice(iter(dataset), n))
    return [dataset[i] for i in range(min(n, len(dataset)))]
