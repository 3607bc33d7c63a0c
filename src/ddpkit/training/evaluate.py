"""Evaluation: loss and metric over the whole eval set, every sample counted exactly once
(contiguous unpadded slices per rank, sums across ranks: no DistributedSampler padding).
The loss comes from the same place as in training (batches.compute_loss): a step hook's
(loss_sum, count) gives the exact mean over tokens; a mean loss is weighted by samples."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..runtime import Runtime
from ..strategies import Strategy
from ..task import accuracy_sum
from .batches import compute_loss, sample_count, to_device


def evaluate(
    model: torch.nn.Module,
    dataset: Any,
    loss_fn: Callable | None,
    metric: Callable | None,
    metric_name: str,
    rt: Runtime,
    strategy: Strategy,
    batch_size: int,
    num_workers: int = 0,
    step: Callable | None = None,
) -> dict[str, float]:
    """{'eval_loss': ..., 'eval_<metric_name>': ...}: global means, the same on every rank.
    With no metric, classification outputs of (inputs..., target) items get accuracy."""
    module = strategy.eval_module(model)
    was_training = module.training
    module.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=rt.device)  # loss, loss count, metric, samples with a metric
    with torch.no_grad():
        for batch in strategy.eval_batches(dataset, batch_size, num_workers):
            n = sample_count(batch)
            if n == 0:  # this rank's empty share: a sharded or split model still needs it in the forward
                batch = _stand_in(dataset)  # one sample, counted nowhere (a forward of none fails `view(B, T, -1, D)`)
            batch = to_device(batch, rt.device)
            with strategy.autocast():
                forward = strategy.eval_forward(module, batch, n)  # None: no output on this rank (pipeline stage)
                if forward is None:
                    continue
                loss = compute_loss(forward, batch, n, loss_fn, step, rt.device)
            if n == 0:
                continue
            sums[0] += loss.value.double() * (1.0 if loss.summed else n)
            sums[1] += loss.count
            score = _metric(metric, loss.output, batch, loss_fn, step)
            if score is not None:
                sums[2] += torch.as_tensor(score, dtype=torch.float64, device=rt.device)
                sums[3] += n
    module.train(was_training)
    total = rt.all_sum(sums)
    result = {"eval_loss": total[0].item() / total[1].item()}
    if total[3].item() > 0:
        result[f"eval_{metric_name}"] = total[2].item() / total[3].item()
    return result


def _stand_in(dataset: Any) -> Any:
    """The eval set's first sample as a batch of one."""
    from ..data.sharding import fetch_batches

    return next(fetch_batches(dataset, [torch.arange(1)]))


def _metric(metric: Callable | None, out: Any, batch: Any, loss_fn: Callable | None, step: Callable | None) -> Any:
    """The batch's metric sum: the task's metric(output, target) (dict batches: (output, batch)),
    or accuracy for plain class scores of (inputs..., target) items."""
    target = batch if isinstance(batch, dict) else batch[-1]
    if metric is not None:
        return metric(out, target)
    plain = loss_fn is None or isinstance(loss_fn, torch.nn.CrossEntropyLoss)
    if plain and step is None and not isinstance(batch, dict) and isinstance(out, torch.Tensor) and out.dim() == 2:
        return accuracy_sum(out, target)
    return None
