"""One pass over the training data (EpochRun) and what the run's summary counts (RunTotals)."""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Iterator

import torch

from ..checkpoint.state import Position
from ..data.placement import ON_DEVICE
from ..errors import DdpkitError
from ..runtime import Runtime
from .prefetch import Prefetcher


class EpochRun:
    """One pass: trains this rank's steps and keeps the pass's running figures: this rank's
    [loss sum, count] (rank 0 also carries the global sums of the samples trained before a
    mid-epoch stop), the pass's global samples done (its position in the global order),
    skipped steps, time."""

    def __init__(
        self,
        rt: Runtime,
        progress: Any,
        loader: Any,
        steps: Any,
        epoch: int,
        start: Position,
        clock: Any = None,
        profile: Any = None,
    ) -> None:
        self.rt, self.progress, self.loader, self.steps, self.epoch = rt, progress, loader, steps, epoch
        self.clock = clock  # stragglers.StepClock: where this rank's step time goes
        self.profile = profile  # profile.StepProfile (DDPKIT_PROFILE_STEPS), or None
        self.steps_done = 0
        self.complete = False  # the pass ran to its end
        self.sums = torch.zeros(2, dtype=torch.float64, device=rt.device)  # loss sum, count (samples or tokens)
        # one rank per data-parallel share adds its loss (parallel/dims.py): a tp group's ranks compute the
        # same one, and a position's sums are of the global order's samples, whatever mesh resumes them
        self.counts = getattr(getattr(rt, "dims", None), "counts_samples", True)
        carried = (
            (start.loss_sum, start.count_sum or float(start.samples)) if start.mid_epoch and rt.is_main else (0.0, 0.0)
        )
        if start.mid_epoch and rt.is_main:
            self.sums += torch.tensor(carried, dtype=torch.float64, device=rt.device)
        self.samples = start.samples  # global samples of this pass's order trained so far (before a resume too)
        self.samples_here = 0
        self.skipped = 0
        self.t0 = time.perf_counter()
        self.epoch_s = 0.0
        skipped = start.samples if loader.n is not None else 0
        progress.start_epoch(epoch, skipped_samples=skipped, loss_offset=carried[0], count_offset=carried[1])

    def train(self, global_step: int, until: Callable[[], bool]) -> Iterator[Any]:
        """Runs the pass's optimizer steps, yielding each step's result, until the pass ends or
        `until()` says the run has reached its last step. `global_step`: steps done before."""
        batches = self.loader.iter_steps()
        # a stream's position must not include a batch taken ahead; batches gathered on the device need no copy
        if self.loader.n is not None and getattr(self.loader, "data", None) != ON_DEVICE:
            batches = iter(Prefetcher(batches, self.rt.device))
        if self.profile is not None:  # the profiler steps at each fetch: its steps are whole loop iterations
            batches = self.profile.around(batches, global_step)
        ended = None  # this thread's CPU clock at the last step's end
        while not until():  # asked before the next batch is taken: a stream's saved position must not include it
            if ended is not None and self.clock is not None:
                self.clock.between_steps(time.thread_time() - ended)
            t0 = time.perf_counter()
            item = next(batches, None)
            if item is None:
                self.complete = True
                self.settle()
                return
            batch, n_local, n_global = item
            t1, waited = time.perf_counter(), self.steps.wait_s
            result = self.steps.run(batch, n_local, n_global, where=f"epoch {self.epoch + 1}, step {global_step + 1}")
            ended = time.thread_time()
            global_step += 1
            if self.clock is not None:
                self.clock.step(t1 - t0, time.perf_counter() - t1, self.steps.wait_s - waited)
                self.clock.step_done(global_step)
            self.add(result, n_local, n_global)
            yield result
        self.settle()

    def settle(self) -> None:
        """Before anything reads this pass's figures or weights (its end, a moment inside it): the
        last step's agreement, when the device decided it (training/step.py: raises for a
        non-finite step under --on-nan stop, counts a skipped one)."""
        self.skipped += self.steps.settle()

    def add(self, result: Any, n_local: int, n_global: int) -> None:
        self.steps_done += 1
        self.samples += n_global
        self.samples_here += n_global
        self.skipped += result.skipped  # --on-nan skip: this step (host) or the one before (device)
        if result.loss_sum is None:
            return
        if self.counts:
            self.sums += result.loss_sum
        self.progress.step(n_local, n_global, self.sums)

    def position(self, global_step: int) -> Position:
        """Where a checkpoint taken now resumes, in samples of the pass's global order: the next
        epoch once this pass is complete, else this one after its samples so far (a collective:
        the global loss sums so far)."""
        global_batch = self.loader.global_batch_size
        if self.complete or (self.loader.n is not None and self.samples >= self.loader.n):
            return Position(self.epoch + 1, global_step=global_step, global_batch=global_batch)
        loss, count = self.rt.all_sum(self.sums).tolist()
        return Position(self.epoch, self.samples, loss, count, global_step=global_step, global_batch=global_batch)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def finish(self, global_step: int) -> dict[str, Any]:
        """The pass's record: its global mean training loss (one all-reduce)."""
        loss, count = self.rt.all_sum(self.sums).tolist()
        train_loss = loss / count if count else float("nan")
        self.epoch_s = self.elapsed()
        if not math.isfinite(train_loss):
            raise DdpkitError(
                f"the training loss is {train_loss} in epoch {self.epoch + 1}; no checkpoint of these weights "
                "was written (lower --lr?)"
            )
        record: dict[str, Any] = {"epoch": self.epoch + 1, "step": global_step, "train_loss": train_loss}
        if self.skipped:
            record["skipped_steps"] = self.skipped
        return record

    def rates(self) -> dict[str, Any]:
        s = self.epoch_s
        return {"epoch_s": round(s, 6), "samples_per_s": round(self.samples_here / s, 2) if s > 0 else None}


class RunTotals:
    """What the run's summary counts: epochs done, training time, samples, an early stop."""

    def __init__(self, resumed_from: int) -> None:
        self.resumed_from = resumed_from
        self.last: dict[str, Any] = {}
        self.train_s = 0.0
        self.samples = 0
        self.stopped_early = False
        self.stop_signal: str | None = None

    def add_epoch(self, record: dict[str, Any], epoch_run: EpochRun) -> None:
        self.last = record
        self.train_s += epoch_run.epoch_s
        self.samples += epoch_run.samples_here

    def stop(self, seconds: float, signal: str | None) -> None:
        self.train_s += seconds
        self.stopped_early = True
        self.stop_signal = signal

    def summary(self, metric_name: str) -> dict[str, Any]:
        last = self.last
        return {
            "epochs_done": last.get("epoch", self.resumed_from),
            "train_loss": last.get("train_loss"),
            "eval_loss": last.get("eval_loss"),
            f"eval_{metric_name}": last.get(f"eval_{metric_name}"),
            "train_s": self.train_s,
            "samples_per_s": self.samples / self.train_s if self.train_s > 0 and self.samples else None,
            "resumed_from_epoch": self.resumed_from,
            "stopped_early": self.stopped_early,
            "stop_signal": self.stop_signal,
        }
