"""The FLOPs of one training sample, counted once before training from the real model, and the
tokens a sample holds: what turns the samples/s the loop times into TFLOP/s, MFU and tokens/s
(reporting/throughput.py).

The count is torch's FlopCounterMode over one forward and backward of a micro-batch, on the
meta device: the model with its parameters and buffers swapped for meta tensors for the
moment (shapes only: no memory, no arithmetic), fed a micro-batch of the first sample's
shapes, its loss taken as the loop takes it (training/batches.py: compute_loss) but for two
things: no hook of the model runs, and a task's loss_fn is not called (the outputs' sum stands
in for it): the count is no training step, and user code that counts its calls must not see
it. It counts the matrix products
(linear layers, attention's two products, convolutions), forward and backward (the backward
~2x the forward); elementwise work (norms, activations, the softmax) is not counted, as
MFU's convention has it. Attention takes its math path on the meta device, whose products
the counter counts in full (the causal half included, as the usual 6N + 12 L T d formula
does). What activation checkpointing recomputes is not counted either: MFU counts the
model's FLOPs, not the hardware's. A model that cannot run on the meta device (data-dependent
shapes, a kernel without a meta implementation) is not counted: the reason is kept instead.

A Hugging Face model that the meta device cannot run (its mask code reads the mask's values)
is estimated from its config instead, as the usual decoder estimate (Kaplan et al.; PaLM's
appendix) does: 6 N + 12 L T d FLOPs a token, forward and backward, for N parameters (the
embeddings only looked up left out; a tied output head kept: it is a product), L layers of
width d and T tokens a sample; `flops_note` says it was estimated.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils.data import IterableDataset, default_collate

from ..reporting.throughput import Throughput, device_peak
from ..task import Task
from ..util.tree import map_tensors, tensors
from .batches import compute_loss

META = torch.device("meta")


def first_sample(dataset: Any) -> Any:
    """The data set's first item (a stream's first), or None when it has none."""
    if isinstance(dataset, IterableDataset):
        return next(itertools.islice(iter(dataset), 1), None)
    return dataset[0] if len(dataset) else None


def tokens_in(sample: Any) -> int | None:
    """The tokens one sample holds: the length of its first integer tensor of one dimension
    (token ids, batched to [B, T]), or None when it has none (features, images, a class label)."""
    for t in tensors(sample):
        if t.dim() == 1 and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool and len(t) > 1:
            return int(len(t))
    return None


@contextlib.contextmanager
def on_meta(model: nn.Module) -> Iterator[nn.Module]:
    """`model` with its parameters and buffers swapped, for the block, for empty tensors of the
    same shapes on the meta device (tied weights stay tied), then put back. Swapped rather
    than copied: a copy would have to copy whatever else the model holds (the hang watchdog's
    hook, a user's handles), which may not copy at all."""
    swapped: dict[int, Any] = {}
    held: list[tuple[dict[str, Any], str, Any]] = []  # (the module's dict, name, the real tensor)
    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if t is None:
                        continue
                    if id(t) not in swapped:
                        empty = torch.empty_like(t, device="meta")
                        is_param = isinstance(t, nn.Parameter)
                        swapped[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if is_param else empty
                    held.append((table, name, t))
                    table[name] = swapped[id(t)]
        yield model
    finally:
        for table, name, t in reversed(held):
            table[name] = t


# A module's hooks, set aside while the count runs: a user's hook counts, logs, sleeps or fails
# on its Nth training forward, and the count is no training forward (nor is ddpkit's watchdog's)
_HOOKS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)


@contextlib.contextmanager
def without_hooks(model: nn.Module) -> Iterator[nn.Module]:
    """`model` with every module's forward and backward hooks set aside for the block, then put
    back as they were (torch's global module hooks stay: they are no module's)."""
    held: list[tuple[nn.Module, str, Any]] = []
    try:
        for module in model.modules():
            for name in _HOOKS:
                hooks = getattr(module, name, None)
                if hooks:
                    held.append((module, name, hooks))
                    setattr(module, name, type(hooks)())
        yield model
    finally:
        for module, name, hooks in held:
            setattr(module, name, hooks)


def meta_batch(sample: Any, batch_size: int) -> Any:
    """A micro-batch of `batch_size` samples shaped like `sample`, on the meta device."""
    return map_tensors(
        default_collate([sample]), lambda t: torch.empty((batch_size, *t.shape[1:]), dtype=t.dtype, device="meta")
    )


def _sum_of_outputs(out: Any, target: Any) -> torch.Tensor:
    """The loss the count backpropagates in place of a task's loss_fn, which it never calls (it
    may count its calls, or log): the sum of the model's floating outputs, whose backward runs
    every product of the model's backward as the real loss's does (a loss's own arithmetic is
    no matrix product: the count leaves it out either way)."""
    return sum(t.sum() for t in tensors(out) if t.is_floating_point())


def count_flops(task: Task, batch_size: int, sample: Any) -> tuple[float | None, str]:
    """FLOPs of one sample's forward and backward, counted over a micro-batch of `batch_size`
    samples shaped like `sample` on the meta device (see the module's docstring), and "";
    or (None, why not)."""
    from torch.utils.flop_counter import FlopCounterMode

    model, was_training = task.model, task.model.training
    try:
        with on_meta(model), without_hooks(model), torch.enable_grad(), FlopCounterMode(display=False) as counter:
            model.train()
            loss_fn = None if task.loss_fn is None else _sum_of_outputs  # the task's own: called only in steps
            loss = compute_loss(model, meta_batch(sample, batch_size), batch_size, loss_fn, task.step, META)
            if loss.value is None or not loss.value.requires_grad:
                return None, "the loss does not depend on the model's parameters"
            loss.value.backward()
    except Exception as e:  # the run goes on without the figure
        return None, f"one forward and backward on the meta device failed: {type(e).__name__}: {e}"
    finally:
        model.train(was_training)
    total = counter.get_total_flops()
    if not total:
        return None, "the counter found no matrix product in the model's forward and backward"
    return total / batch_size, ""


def _config_int(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def config_flops(model: nn.Module, tokens: int | None) -> float | None:
    """A Hugging Face model's FLOPs a sample from its config (see the module's docstring), or None
    (not a transformers model, no layer count or width in its config, no token dimension)."""
    config = getattr(model, "config", None)
    if not tokens or config is None or not type(model).__module__.startswith("transformers"):
        return None
    layers = _config_int(config, "num_hidden_layers", "n_layer", "num_layers")
    width = _config_int(config, "hidden_size", "n_embd", "d_model")
    if layers is None or width is None:
        return None
    products = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    looked_up = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters() if id(p) not in products
    }
    n = sum(p.numel() for p in model.parameters() if id(p) not in looked_up)
    return float((6 * n + 12 * layers * tokens * width) * tokens)


def throughput_of(task: Task, cfg: Any, rt: Any, precision: str) -> Throughput:
    """What this run's rates are made of (reporting/throughput.py): the FLOPs of one sample
    at the run's micro-batch, the tokens it holds (the task's tokens_per_sample first), the
    world size and the peak of one device at `precision` (--peak-tflops first). Counted the
    same on every rank, before the model is set up."""
    try:
        sample = first_sample(task.train_set)
    except Exception as e:  # a data set that cannot be read here: the loop will say so itself
        sample, note = None, f"its first sample could not be read: {type(e).__name__}: {e}"
    else:
        note = "the training set is empty" if sample is None else ""
    flops = None
    tokens = task.tokens_per_sample if task.tokens_per_sample is not None else tokens_in(sample)
    if sample is not None:
        flops, note = count_flops(task, cfg.batch_size, sample)
        estimate = config_flops(task.model, tokens) if flops is None else None
        if estimate is not None:
            flops, note = estimate, f"estimated from the model's config (6N + 12LTd a token): {note}"
    peak, source = device_peak(rt.device, precision, cfg.peak_tflops)
    return Throughput(flops, tokens or None, rt.world_size, peak, source, note)
