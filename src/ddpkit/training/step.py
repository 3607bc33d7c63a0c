"""One optimizer step: the micro-batches of this rank's share, the agreement of all ranks on
NaN/inf losses and stop signals, the backward passes and the optimizer step.

Why each piece is here:
  * Micro-batches (--accumulate K): the share is cut into K contiguous parts; all but the
    last run under the strategy's no_sync, so gradients travel once per optimizer step.
  * Weights: each micro-batch's mean loss is scaled by its share of the global batch
    (n_micro x dp / n_global, dp: the data-parallel ranks the gradients are averaged over,
    rt.dims.dp; the ranks of one tp group see the same samples), so the averaged gradient is
    exactly the mean over the global batch, as on one process, also for a short last batch. A task's step hook that
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

Who decides, and when (no host synchronisation in a step):
  * On the device, this step: whether the weights move. An optimizer that takes a found_inf
    tensor (torch's fused Adam/AdamW/SGD/Adagrad: what --fused-optimizer auto builds on a GPU)
    skips its update, its state and step count included, when the agreed flags say a loss
    was not finite (or the run directory is taken, or an earlier step stopped the run): the
    weights never take a non-finite step, and nothing is read on the host. Another optimizer
    of torch.optim, fp16's gradient scaler and FSDP's shards skip it by a snapshot put back on
    the device (training/skipping.py). The count of a summed loss divides the gradients on
    the device too; a skipped step adds nothing to the pass's loss sums.
  * On the host, one step later (training/deferred.py): the flags' copy is read at the end of
    the next step, or at the pass's end or a moment (checkpoint, evaluation) before it, which
    synchronise anyway (settle). Then --on-nan stop raises naming the step that was not
    finite, --on-nan skip counts it, a stop asked by a signal and a timed save take effect
    at that boundary: one step later than the step whose agreement carried them, the same
    step on every rank (every rank reads the same reduced numbers).
  * What users see differently from a host decision: a step skipped on the device still
    advances the LR schedule (as under torch's GradScaler); a stop by signal or a timed save
    lands one step later.
  * The host decides at once, reading the flags after the backward (the one host
    synchronisation a step then has), where the device cannot or need not: the run's first
    step (the optimizer's state is created then), an optimizer outside torch.optim without
    found_inf, state a snapshot cannot hold (not a tensor, or not on the step's device), and on
    a CPU an optimizer without found_inf (a read there waits for nothing; a snapshot would cost
    copies: `device_decides` asks for it anyway).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn

from ..errors import DdpkitError
from ..runtime import Runtime
from ..strategies import Strategy
from ..strategies.activation import SavedBytes
from .batches import compute_loss, sample_count, split, to_device, zero_loss
from .deferred import HostFlags
from .prefetch import expected_sync
from .signals import StopRequest
from .skipping import (
    Snapshot,
    keep_step_counts_on_device,
    params_of,
    scaled_skipping_step,
    skipping_step,
    state_is_tensors,
)

FLAGS = 5  # the step's agreement: not finite, stop, count, timed save, run directory taken


@dataclass
class StepResult:
    loss_sum: torch.Tensor | None  # [this rank's loss sum, its count] (zeros or None: the step was skipped)
    stop: bool  # some rank asked to stop: save at this step boundary
    save: bool = False  # rank 0's clock says --save-every-minutes is due
    skipped: int = 0  # steps found skipped (--on-nan skip) now: this one (host) or the one before (device)


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
    last_grad_norm: float | torch.Tensor | None = None  # a tensor on the device until read
    timed_save: Callable[[], bool] | None = None  # rank 0's clock says a checkpoint is due (--save-every-minutes)
    wait_s: float = 0.0  # seconds this rank waited for the gradient sync (the others) after its backward, in all
    after_step: Callable[[], None] | None = None  # called after every optimizer step (ddpkit verify's trace)
    finite_checkpoint: Callable[[], str | None] | None = None  # the newest checkpoint seen to hold finite weights
    mark: Any = None  # checkpoint/world_mark.py: does this world still own the run directory (rank 0's stat)
    activation_bytes: int | None = None  # what the first forward kept for backward (the summary's)
    _output_checked: bool = False
    _stepped: bool = False  # an optimizer step has run: its state exists (the device may decide from now on)
    device_decides: bool | None = None  # without found_inf, decide on the device by a snapshot (None: not on a CPU)
    _how: str | None = None  # "found_inf", "snapshot" or "host" (see _on_device)
    _snapshot: Snapshot | None = None
    _halt: torch.Tensor | None = None  # on the device: an agreed stop (NaN under --on-nan stop, taken): no update
    _host: HostFlags = field(default_factory=HostFlags)  # the step before's flags, read a step later

    def run(self, batch: Any, n_local: int, n_global: int, where: str) -> StepResult:
        """One optimizer step over this rank's share of a global batch of `n_global` samples.
        `where` names the step in errors ("epoch 3, step 7")."""
        agreement = self.strategy.agreement(self.model)
        waited = agreement.waited_s if agreement is not None else 0.0
        totals, flags, summed = self._backward_share(batch, n_local, n_global, agreement)
        agreed = self._agreed_tensor(flags, agreement, waited)
        if not self._on_device():
            return self._decide_on_host(agreed, totals, summed, where)
        skip = self._guard(agreed)  # a bool on the device: the weights stay as they are
        if summed:
            self._scale_grads(self.rt.world_size / torch.where(agreed[2] > 0, agreed[2], self.rt.world_size))
        self._optimizer_step(found_inf=skip)
        stop, save, skipped = self._act(self._host.receive())  # the step before's agreement
        self._host.send(agreed, where)
        return StepResult(torch.where(skip, torch.zeros_like(totals), totals), stop, save, skipped)

    def _backward_share(
        self, batch: Any, n_local: int, n_global: int, agreement: Any
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Forward and backward of every micro-batch of this rank's share; the flags armed for
        the last backward's gradient sync. Returns ([loss sum, count], this rank's flags,
        whether the task's losses are sums)."""
        world = self.rt.dims.dp  # the gradients are averaged over the data-parallel ranks only
        pending = None  # non-finite losses of earlier micro-batches (no extra collective)
        totals = torch.zeros(2, dtype=torch.float64, device=self.rt.device)  # loss sum, count
        kinds: set[bool] = set()
        flags = torch.zeros(FLAGS, dtype=torch.float64, device=self.rt.device)
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
        return totals, flags, True in kinds

    def _decide_on_host(self, agreed: torch.Tensor, totals: torch.Tensor, summed: bool, where: str) -> StepResult:
        """The host reads this step's agreement now (one synchronisation) and steps, skips or stops."""
        before = self._act(self._host.receive())  # nothing, unless the device decided the step before
        bad, stop_now, global_count, save_now, taken = self._read(agreed)
        self._act_on(bad, taken, where)
        if bad:  # --on-nan skip: every rank drops this step
            return StepResult(None, before[0], before[1], before[2] + 1)
        if summed and global_count:
            self._scale_grads(self.rt.world_size / global_count)  # summed losses: the mean over every rank's count
        self._optimizer_step()
        return StepResult(totals, stop_now or before[0], save_now or before[1], before[2])

    def _act(self, received: tuple[list[float], str] | None) -> tuple[bool, bool, int]:
        """A step's agreement read on the host: raises (taken; not finite under --on-nan stop),
        else (stop asked, timed save due, 1 if the step was skipped)."""
        if received is None:
            return False, False, 0
        (bad, stopping, _, save, taken), where = received
        self._act_on(int(bad), taken > 0, where)
        if bad:
            return False, False, 1  # a skipped step's stop and save wait for the next step, as on the host
        return stopping > 0, save > 0, 0

    def _act_on(self, bad: int, taken: bool, where: str) -> None:
        world = self.rt.world_size
        if taken:  # every rank, at this step, before its optimizer step: the other world's files stay as they are
            self.optimizer.zero_grad(set_to_none=True)
            raise self.mark.error(where)
        if bad:
            self.optimizer.zero_grad(set_to_none=True)  # drop the non-finite gradients, on every rank
            if self.on_nan == "stop":
                held = self.finite_checkpoint() if self.finite_checkpoint is not None else None
                kept = (
                    f"{held} holds finite weights (checked when it was written or resumed from)"
                    if held
                    else "no checkpoint was written"
                )
                raise DdpkitError(
                    f"the training loss is not finite in {where} (on {bad} of {world} rank(s)); stopped before the "
                    f"optimizer step; {kept} (lower --lr, check the data, or --on-nan skip)"
                )

    def settle(self) -> int:
        """At a point that synchronises anyway (a pass's end, a checkpoint, an evaluation, the
        run's end): act on the last step's agreement if the device decided it (raise, see _act);
        returns 1 if that step was skipped, else 0."""
        return self._act(self._host.receive())[2]

    def _on_device(self) -> bool:
        """Can the device decide this step (the module's docstring says when it cannot)?"""
        if not self._stepped:
            return False
        if self._how is None:
            self._how = self._choose()
            if self._how == "snapshot":
                self._snapshot = Snapshot(self.optimizer)
        return self._how != "host"

    def _choose(self) -> str:
        """How a step is skipped on the device: "found_inf", "snapshot", or "host" (it is not)."""
        from torch.distributed.tensor import DTensor

        params = params_of(self.optimizer)
        sharded = any(isinstance(p, DTensor) for p in params)
        if bool(getattr(self.optimizer, "_step_supports_amp_scaling", False)) and not sharded:
            return "found_inf"
        wanted = self.device_decides if self.device_decides is not None else self.rt.device.type != "cpu"
        if not wanted or not state_is_tensors(self.optimizer):
            return "host"
        if not sharded:
            keep_step_counts_on_device(self.optimizer, self.rt.device)
        state = [v for s in self.optimizer.state.values() for v in s.values()]
        on_device = all(t.device.type == self.rt.device.type for t in params + state)
        return "snapshot" if on_device else "host"

    def _guard(self, agreed: torch.Tensor) -> torch.Tensor:
        """On the device: skip this step's update? (a loss not finite on some rank, or the run
        stopped: the run directory taken, or a non-finite step before under --on-nan stop)."""
        bad = agreed[0] > 0
        halt = (agreed[4] > 0) | bad if self.on_nan == "stop" else agreed[4] > 0
        self._halt = halt if self._halt is None else self._halt | halt
        return bad | self._halt

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

    def _agreed_tensor(self, flags: torch.Tensor, agreement: Any, waited: float) -> torch.Tensor:
        """The step's flags summed over the ranks, on the device: as the gradient sync carried
        them, else by an all-reduce issued now, after the backward."""
        agreed = agreement.collect() if agreement is not None else None
        if agreed is None:
            t0 = time.perf_counter()
            agreed = self.rt.collectives.all_reduce_(flags)
            self.wait_s += time.perf_counter() - t0
        if agreement is not None:
            self.wait_s += agreement.waited_s - waited
        return agreed

    @staticmethod
    def _read(agreed: torch.Tensor) -> tuple[int, bool, float, bool, bool]:
        """The agreed flags on the host: a host synchronisation on a GPU (the host decides)."""
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

    def _scale_grads(self, factor: float | torch.Tensor) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor.to(p.grad.dtype) if isinstance(factor, torch.Tensor) else factor)

    def _optimizer_step(self, found_inf: torch.Tensor | None = None) -> None:
        """Clip, step, zero the gradients, step the scheduler. `found_inf` (a bool on the
        device): the optimizer skips its update where it is true (its found_inf, as under
        torch's GradScaler)."""
        if self.clip_grad_norm is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            norm = self.strategy.clip_grad_norm_(self.model, self.clip_grad_norm)
            if found_inf is not None and isinstance(self.last_grad_norm, torch.Tensor):
                norm = torch.where(found_inf, self.last_grad_norm, norm)  # a skipped step's norm is not kept
            self.last_grad_norm = norm  # read on the host at the pass's end (figures)
        if found_inf is not None and self.scaler is not None:
            scaled_skipping_step(
                self.scaler, self.optimizer, found_inf, self._snapshot, self.clip_grad_norm is not None
            )
        elif self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif found_inf is not None:
            skipping_step(self.optimizer, found_inf, self._snapshot)
        else:
            self.optimizer.step()
        self._stepped = True
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        if self.after_step is not None:
            self.after_step()

    def figures(self) -> dict[str, Any]:
        """For the epoch's record: the last step's gradient norm before clipping (read on the host now)."""
        return {"grad_norm": float(self.last_grad_norm)} if self.last_grad_norm is not None else {}

    def flags(
        self, loss: torch.Tensor | None, pending: torch.Tensor | None = None, count: torch.Tensor | float = 0.0
    ) -> tuple[int, bool, float, bool, bool]:
        """(ranks whose loss is not finite, whether any rank asked to stop, the global count,
        whether rank 0's clock says a timed checkpoint is due, whether rank 0 found the run
        directory taken): the same on every rank, by an all-reduce of its own (between epochs; a
        step's ride with its gradient sync)."""
        return self._read(self._agreed_tensor(self._local_flags(loss, pending, count), None, 0.0))

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
