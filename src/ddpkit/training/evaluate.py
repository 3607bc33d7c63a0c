"""Evaluation: loss and metric over the whole eval set, every sample counted exactly once
(contiguous unpadded slices per rank, sums across ranks: no DistributedSampler padding)."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..runtime import Runtime
from ..strategies import Strategy
from .step import to_device


def evaluate(model: torch.nn.Module, dataset: Any, loss_fn: Callable, metric: Callable | None, metric_name: str,
             rt: Runtime, strategy: Strategy, batch_size: int, num_workers: int = 0) -> dict[str, float]:
    """{'eval_loss': ..., 'eval_<metric_name>': ...}: global means, the same on every rank."""
    module = strategy.eval_module(model)
    was_training = module.training
    module.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=rt.device)  # loss, metric, count
    with torch.no_grad():
        for batch in strategy.eval_batches(dataset, batch_size, num_workers):
            *inputs, target = to_device(batch, rt.device)
            with strategy.autocast():
                out = module(*inputs)
            n = len(target)
            if n == 0:
                continue
            sums[0] += loss_fn(out, target).double() * n
            if metric is not None:
                sums[1] += torch.as_tensor(metric(out, target), dtype=torch.float64, device=rt.device)
            sums[2] += n
    module.train(was_training)
    total = rt.all_sum(sums)
    count = total[2].item()
    result = {"eval_loss": total[0].item() / count}
    if metric is not None:
        result[f"eval_{metric_name}"] = total[1].item() / count
    return result
