"""One optimizer step: the micro-batches of this rank's share, the agreement of all ranks on
NaN/inf losses and stop signals, the backward passes and the optimizer step.

Why each piece is here:
  * Micro-batches (--accumulate K): the share is cut into K contiguous parts; all but the
    last run under the strategy's no_sync, so gradients travel once per optimizer step.
  * Weights: each micro-batch's loss is scaled by its share of the global batch
    (n_micro x world / n_global), so the averaged gradient is exactly the mean over the
    global batch, as on one process, also for a short last batch.
  * Agreement: one small all-reduce per optimizer step carries (any loss not finite, any
    rank asked to stop): every rank takes the same branch, so none waits for a collective
    the others skip.
  * An empty share (more ranks than samples left) still joins the gradient sync, with zeros.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..errors import DdpkitError
from ..runtime import Runtime
from ..strategies import Strategy
from .signals import StopRequest


@dataclass
class StepResult:
    loss_sum: torch.Tensor | None  # this rank's loss summed over its samples (None: the step was skipped)
    stop: bool  # some rank asked to stop: save at this step boundary


@dataclass
class StepRunner:
    """Runs optimizer steps of one model; the same object for the whole run."""

    rt: Runtime
    strategy: Strategy
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[..., torch.Tensor]
    accumulate: int = 1
    on_nan: str = "stop"
    stop: StopRequest | None = None

    def run(self, batch: Any, n_local: int, n_global: int, where: str) -> StepResult:
        """One optimizer step over this rank's share of a global batch of `n_global` samples.
        `where` names the step in errors ("epoch 3, step 7")."""
        world = self.rt.world_size
        pending = None  # non-finite losses of earlier micro-batches (no extra collective)
        losses = []
        bad = 0
        stop_now = False
        for micro, n_micro, last in iter_micro(batch, n_local, self.accumulate):
            if not last and not n_micro:
                continue  # an empty micro-batch outside the sync adds nothing
            *inputs, target = to_device(micro, self.rt.device)
            with self.strategy.no_sync(self.model, skip_sync=not last):
                with self.strategy.autocast():
                    out = self.model(*inputs)
                    loss = self.loss_fn(out, target) if n_micro else None
                if last:
                    bad, stop_now = self.flags(loss, pending)
                    if bad:
                        break
                elif loss is not None:
                    nonfinite = (~torch.isfinite(loss.detach())).float()
                    pending = nonfinite if pending is None else pending + nonfinite
                if loss is not None:
                    scale = n_micro * world / n_global
                    (loss if scale == 1.0 else loss * scale).backward()
                    losses.append(loss.detach().double() * n_micro)
                else:  # no sample for this rank in a short last batch: join the gradient sync with zeros
                    (first_tensor(out).sum() * 0.0).backward()
        if bad:
            self.optimizer.zero_grad(set_to_none=True)  # drop what earlier micro-batches accumulated
            if self.on_nan == "stop":
                raise DdpkitError(
                    f"the training loss is not finite in {where} (on {bad} of {world} rank(s)); stopped before the "
                    "optimizer step, so the last checkpoint holds finite weights (lower --lr, check the data, or --on-nan skip)")
            return StepResult(None, False)  # --on-nan skip: every rank drops this step
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64, device=self.rt.device)
        for part in losses:
            total += part
        return StepResult(total, stop_now)

    def flags(self, loss: torch.Tensor | None, pending: torch.Tensor | None = None) -> tuple[int, bool]:
        """(ranks whose loss is not finite, whether any rank asked to stop): the same on every rank.
        `pending`: non-finite losses of earlier micro-batches of this step on this rank."""
        flags = torch.zeros(2, device=self.rt.device)
        if loss is not None:
            flags[0] = (~torch.isfinite(loss.detach())).float()
        if pending is not None:
            flags[0] = torch.clamp(flags[0] + pending, max=1.0)
        if self.stop is not None and self.stop.received:
            flags[1] = 1.0
        self.rt.collectives.all_reduce_(flags)
        bad, stopping = flags.tolist()
        return int(bad), stopping > 0

    def stop_requested(self) -> bool:
        """Between epochs: has any rank received a stop signal? (A collective when stop is set.)"""
        return self.stop is not None and self.flags(None)[1]


def micro_batches(batch: Any, n_local: int, k: int) -> list[tuple[Any, int]]:
    """Split this rank's share of a step into k contiguous micro-batches whose sizes differ
    by at most one (the first get the extra samples, the last may be empty)."""
    if k == 1:
        return [(batch, n_local)]
    base, extra = divmod(n_local, k)
    sizes = [base + (1 if i < extra else 0) for i in range(k)]
    if isinstance(batch, torch.Tensor):
        return list(zip(torch.split(batch, sizes), sizes))
    if isinstance(batch, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in batch):
        cols = [torch.split(t, sizes) for t in batch]
        return [(tuple(c[i] for c in cols), n) for i, n in enumerate(sizes)]
    raise DdpkitError(f"--accumulate needs batches that are tensors or tuples of tensors, got {type(batch).__name__}")


def iter_micro(batch: Any, n_local: int, k: int) -> Iterator[tuple[Any, int, bool]]:
    """(micro-batch, its size, is the last) for each of the k micro-batches."""
    parts = micro_batches(batch, n_local, k)
    for i, (b, n) in enumerate(parts):
        yield b, n, i == len(parts) - 1


def to_device(batch: Any, device: torch.device) -> list[Any]:
    if not isinstance(batch, (list, tuple)) or len(batch) < 2:
        raise DdpkitError("each item of the training set must be (inputs..., target); got a single value")
    if device.type == "cpu":
        return list(batch)
    return [b.to(device, non_blocking=True) if isinstance(b, torch.Tensor) else b for b in batch]


def first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        out = list(out.values())
    return next(o for o in out if isinstance(o, torch.Tensor))
