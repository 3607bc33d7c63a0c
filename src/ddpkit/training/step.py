"""One optimizer step: the micro-batches of this rank's share, the agreement of all ranks on
NaN/inf losses and stop signals, the backward passes and the optimizer step.

Why each piece is here:
  * Micro-batches (--accumulate K): the share is cut into K contiguous parts; all but the
    last run under the strategy's no_sync, so gradients travel once per optimizer step.
  * Weights: each micro-batch's mean loss is scaled by its share of the global batch
    (n_micro x world / n_global), so the averaged gradient is exactly the mean over the
    global batch, as on one process, also for a short last batch. A task's step hook that
    returns (loss_sum, count) is summed instead, and the synced gradients are divided by
    the count over every micro-batch and rank (world / global count, after the sync).
  * Agreement: (any loss not finite, any rank asked to stop, this rank's count, a timed save
    due, rank 0 found the run directory taken by another world) summed over the ranks: every
    rank takes the same branch, so none waits for a collective the others skip. The numbers
    ride with the gradient sync of the last backward (strategies/agreement.py), so a step
    costs no collective of its own; a rank whose loss is not finite still runs that
    backward, and every rank drops the gradients.
  * Then, in this order: clip the global gradient norm (--clip-grad-norm; unscaled first
    under fp16), the optimizer step (through the gradient scaler under fp16), the LR
    scheduler's step.
  * An empty share (more ranks than samples left) still joins the gradient sync, with zeros.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn

from ..errors import DdpkitError
from ..runtime import Runtime
from ..strategies import Strategy
from ..strategies.activation import SavedBytes
from .batches import compute_loss, sample_count, split, to_device, zero_loss
from .prefetch import expected_sync
from .signals import StopRequest

FLAGS = 5  # the step's agreement: not finite, stop, count, timed save, run directory taken


@dataclass
class StepResult:
    loss_sum: torch.Tensor | None  # [this rank's loss sum, its count] (None: the step was skipped)
    stop: bool  # some rank asked to stop: save at this step boundary
    save: bool = False  # rank 0's clock says --save-every-minutes is due


@dataclass
class StepRunner:
    """Runs optimizer steps of one model; the same object for the whole run."""

    rt: Runtime
    strategy: Strategy
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[..., torch.Tensor] | None = None
    accumulate: int = 1
    on_nan: str = "stop"
    stop: StopRequest | None = None
    step_fn: Callable[..., Any] | None = None  # the task's step(model, batch) hook
    clip_grad_norm: float | None = None
    scheduler: Any = None  # stepped after every optimizer step
    scaler: Any = None  # torch.amp.GradScaler under fp16
    last_grad_norm: float | None = None
    timed_save: Callable[[], bool] | None = None  # rank 0's clock says a checkpoint is due (--save-every-minutes)
    wait_s: float = 0.0  # seconds this rank waited for the gradient sync (the others) after its backward, in all
    after_step: Callable[[], None] | None = None  # called after every optimizer step (ddpkit verify's trace)
    mark: Any = None  # checkpoint/world_mark.py: does this world still own the run directory (rank 0's stat)
    activation_bytes: int | None = None  # what the first forward kept for backward (the summary's)
    _output_checked: bool = False

    def run(self, batch: Any, n_local: int, n_global: int, where: str) -> StepResult:
        """One optimizer step over this rank's share of a global batch of `n_global` samples.
        `where` names the step in errors ("epoch 3, step 7")."""
        world = self.rt.world_size
        pending = None  # non-finite losses of earlier micro-batches (no extra collective)
        totals = torch.zeros(2, dtype=torch.float64, device=self.rt.device)  # loss sum, count
        kinds: set[bool] = set()
        flags = torch.zeros(FLAGS, dtype=torch.float64, device=self.rt.device)
        agreement = self.strategy.agreement(self.model)
        waited = agreement.waited_s if agreement is not None else 0.0
        for micro, n_micro, last in iter_micro(batch, n_local, self.accumulate):
            if not last and not n_micro:
                continue  # an empty micro-batch outside the sync adds nothing
            micro = to_device(micro, self.rt.device)
            with self.strategy.no_sync(self.model, skip_sync=not last):
                loss = self._forward(micro, n_micro, kinds)
                if last:  # the flags ride with this backward's gradient sync (strategies/agreement.py)
                    local_count = totals[1] + (loss.count if loss.value is not None else 0.0)
                    flags = self._local_flags(loss.value, pending, local_count)
                    if agreement is not None:
                        agreement.arm(flags)
                elif loss.value is not None:
                    nonfinite = (~torch.isfinite(loss.value.detach())).double()
                    pending = nonfinite if pending is None else pending + nonfinite
                if loss.value is not None:
                    weighted = loss.value if loss.summed else loss.value * (n_micro * world / n_global)
                    self._backward(weighted)  # a non-finite loss too: every rank joins the sync
                    totals[0] += loss.value.detach().double() * (1.0 if loss.summed else n_micro)
                    totals[1] += loss.count
                else:  # no sample for this rank in a short last batch: join the gradient sync with zeros
                    self._backward(self._empty_share_loss(loss))
        bad, stop_now, global_count, save_now, taken = self._agreed(flags, agreement, waited)
        if taken:  # every rank, at this step, before its optimizer step: the other world's files stay as they are
            self.optimizer.zero_grad(set_to_none=True)
            raise self.mark.error(where)
        if bad:
            self.optimizer.zero_grad(set_to_none=True)  # drop the non-finite gradients, on every rank
            if self.on_nan == "stop":
                raise DdpkitError(
                    f"the training loss is not finite in {where} (on {bad} of {world} rank(s)); stopped before the "
                    "optimizer step, so the last checkpoint holds finite weights "
                    "(lower --lr, check the data, or --on-nan skip)"
                )
            return StepResult(None, False)  # --on-nan skip: every rank drops this step
        if True in kinds and global_count:
            self._scale_grads(world / global_count)  # summed losses: the mean over every rank's count
        self._optimizer_step()
        return StepResult(totals, stop_now, save_now)

    def _forward(self, micro: Any, n_micro: int, kinds: set[bool]) -> Any:
        with self.strategy.autocast(), self._counting() as saved:
            loss = compute_loss(self.model, micro, n_micro, self.loss_fn, self.step_fn, self.rt.device)
        if saved is not None:
            self.activation_bytes = saved.kept()
        if not self._output_checked:
            self.strategy.check_output(loss.output)
            self._output_checked = True
        if loss.value is not None:
            kinds.add(loss.summed)
            if len(kinds) > 1:
                raise DdpkitError(
                    "the task's step(model, batch) returned a loss for some micro-batches and "
                    "(loss_sum, count) for others: return the same kind every time"
                )
        return loss

    def _agreed(self, flags: torch.Tensor, agreement: Any, waited: float) -> tuple[int, bool, float, bool, bool]:
        """The step's flags summed over the ranks: as the gradient sync carried them, else by an
        all-reduce issued now, after the backward. Reading them on the host is the step's one
        host synchronisation on a GPU: whether to step, skip or stop is the host's decision."""
        agreed = agreement.collect() if agreement is not None else None
        if agreed is None:
            t0 = time.perf_counter()
            agreed = self.rt.collectives.all_reduce_(flags)
            self.wait_s += time.perf_counter() - t0
        if agreement is not None:
            self.wait_s += agreement.waited_s - waited
        with expected_sync():
            bad, stopping, total, save, taken = agreed.tolist()
        return int(bad), stopping > 0, total, save > 0, taken > 0

    def _counting(self) -> ContextManager[Any]:
        """The run's first forward counts the activations it keeps (not under torch.compile,
        whose graphs saved-tensor hooks would change)."""
        if self.activation_bytes is not None or self.strategy.config.compile:
            return contextlib.nullcontext()
        return SavedBytes(self.strategy.checkpointed)

    def _backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def _empty_share_loss(self, loss: Any) -> torch.Tensor:
        if self.step_fn is None:
            return zero_loss(loss.output)
        value = loss.output[0] if isinstance(loss.output, (tuple, list)) else loss.output
        if not (isinstance(value, torch.Tensor) and torch.isfinite(value).all()):
            raise DdpkitError(
                "the task's step(model, batch) gave a non-finite loss for a rank's empty share of a short last "
                "batch (a mean over no sample); return (loss_sum, count) from step, which is 0 for no sample"
            )
        return value.sum() * 0.0

    def _scale_grads(self, factor: float) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor)

    def _optimizer_step(self) -> None:
        if self.clip_grad_norm is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            self.last_grad_norm = self.strategy.clip_grad_norm(self.model, self.clip_grad_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        if self.after_step is not None:
            self.after_step()

    def figures(self) -> dict[str, Any]:
        """For the epoch's record: the last step's gradient norm before clipping."""
        return {"grad_norm": self.last_grad_norm} if self.last_grad_norm is not None else {}

    def flags(
        self, loss: torch.Tensor | None, pending: torch.Tensor | None = None, count: torch.Tensor | float = 0.0
    ) -> tuple[int, bool, float, bool, bool]:
        """(ranks whose loss is not finite, whether any rank asked to stop, the global count,
        whether rank 0's clock says a timed checkpoint is due, whether rank 0 found the run
        directory taken): the same on every rank, by an all-reduce of its own (between epochs; a
        step's ride with its gradient sync)."""
        return self._agreed(self._local_flags(loss, pending, count), None, 0.0)

    def _local_flags(
        self, loss: torch.Tensor | None, pending: torch.Tensor | None, count: torch.Tensor | float
    ) -> torch.Tensor:
        """This rank's [loss not finite, asked to stop, count, timed save due, run directory taken], on the device.
        `pending`: non-finite losses of earlier micro-batches of this step on this rank;
        `count`: this rank's samples or tokens in this step."""
        flags = torch.zeros(FLAGS, dtype=torch.float64, device=self.rt.device)
        if loss is not None:
            flags[0] = (~torch.isfinite(loss.detach())).double()
        if pending is not None:
            flags[0] = torch.clamp(flags[0] + pending, max=1.0)
        if self.stop is not None and self.stop.received:
            flags[1] = 1.0
        flags[2] = count
        if self.timed_save is not None and self.timed_save():
            flags[3] = 1.0
        if self.mark is not None and self.mark.lost():
            flags[4] = 1.0
        return flags

    def stop_requested(self) -> bool:
        """Between epochs: has any rank received a stop signal? (A collective when stop is set.)"""
        return self.stop is not None and self.flags(None)[1]


def micro_batches(batch: Any, n_local: int, k: int) -> list[tuple[Any, int]]:
    """Split this rank's share of a step into k contiguous micro-batches whose sizes differ
    by at most one (the first get the extra samples, the last may be empty). Any structure
    (tensors, tuples, dicts, nested) is cut along every tensor's first dimension."""
    if k == 1:
        return [(batch, n_local)]
    base, extra = divmod(n_local, k)
    sizes = [base + (1 if i < extra else 0) for i in range(k)]
    if n_local and sample_count(batch) != n_local:
        raise DdpkitError(
            f"--accumulate: a batch of {n_local} samples holds a tensor of {sample_count(batch)} rows first; "
            "every tensor of a batch needs the samples along its first dimension"
        )
    return list(zip(split(batch, sizes), sizes, strict=True))


def iter_micro(batch: Any, n_local: int, k: int) -> Iterator[tuple[Any, int, bool]]:
    """(micro-batch, its size, is the last) for each of the k micro-batches."""
    parts = micro_batches(batch, n_local, k)
    for i, (b, n) in enumerate(parts):
        yield b, n, i == len(parts) - 1
