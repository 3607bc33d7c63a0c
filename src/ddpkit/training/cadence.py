"""The run's cadence: when to evaluate, save and stop, decided at every step boundary and at
the end of every pass, in this one place. The loop trains and acts on the moments it is
handed; it never re-derives when something is due.

StepPlan is the run in optimizer steps from where it starts, at this world size and batch
(a resume may change both): how many epochs, the planned total (the LR schedule's length),
whether --max-steps ends it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ..checkpoint.state import Position
from ..errors import DdpkitError
from .epoch import EpochRun


class StepPlan:
    """Epochs and optimizer steps of the run from `start`. A stream's pass has no known length:
    it ends when the stream does."""

    def __init__(self, cfg: Any, loader: Any, start: Position) -> None:
        self.n = loader.n
        self.max_steps = cfg.max_steps
        if loader.n is None:
            self.epochs = cfg.epochs if cfg.max_steps is None else 1 << 30
            self.total_steps = cfg.max_steps or 0
        else:
            per_epoch = max(1, len(loader))
            left_now = loader.steps_left(start.samples)  # in the epoch the run starts in
            if cfg.max_steps is None:
                self.epochs = cfg.epochs
                rest = max(0, cfg.epochs - start.epoch - 1) * per_epoch
                self.total_steps = start.global_step + (left_now + rest if start.epoch < cfg.epochs else 0)
            else:  # --max-steps overrides --epochs
                beyond = max(0, cfg.max_steps - start.global_step - left_now)
                self.epochs = start.epoch + 1 + -(-beyond // per_epoch)
                self.total_steps = cfg.max_steps
        self.passes = self.epochs if self.epochs < 1 << 30 else None  # for the progress display
        if not self.total_steps and loader.n is None and (cfg.lr_schedule != "constant" or cfg.warmup_steps):
            raise DdpkitError(
                "--lr-schedule/--warmup-steps over a stream without a length need --max-steps (the schedule's length)"
            )

    def inside(self, samples_done: int) -> bool:
        """Is this step boundary inside the pass (a stream's end is known only once reached)?"""
        return self.n is None or samples_done < self.n

    def last(self, global_step: int) -> bool:
        return self.max_steps is not None and global_step >= self.max_steps


@dataclass(frozen=True)
class Moment:
    """A point of the run where something is due. `pass_end`: the end of a pass (its record
    is written); `stop`: the run ends here, `finished` when it is done rather than stopped by a
    signal."""

    epoch_run: EpochRun
    global_step: int
    pass_end: bool
    evaluate: bool
    save: bool
    stop: bool = False
    finished: bool = False
    snapshot: bool = False  # a step boundary the node's memory snapshots hear of (checkpoint/memory.py)

    def position(self) -> Position:
        """Where a checkpoint taken here resumes (a collective inside a pass: its loss sums)."""
        return self.epoch_run.position(self.global_step)


class Cadence:
    """Runs the passes and says at each boundary what is due: evaluation (every --eval-every
    epochs, every --eval-every-steps steps, at the end), a checkpoint (the checkpointer's
    rules: epochs, steps, minutes, a signal), the end (the last epoch, --max-steps, a signal)."""

    def __init__(
        self,
        plan: StepPlan,
        start: Position,
        eval_every: int,
        eval_every_steps: int | None,
        checkpointer: Any,
        stop_requested: Callable[[], bool],
    ) -> None:
        self.plan, self.start = plan, start
        self.eval_every, self.eval_every_steps = eval_every, eval_every_steps
        self.checkpointer, self.stop_requested = checkpointer, stop_requested
        self.global_step = start.global_step  # optimizer steps done in the run

    def moments(self, start_pass: Callable[[int, Position], EpochRun]) -> Iterator[Moment]:
        """Trains pass after pass and yields every moment where something is due; returns when
        the run ends (so the loop never has to leave two loops)."""
        for epoch in range(self.start.epoch, self.plan.epochs):
            epoch_run = start_pass(epoch, self.start if epoch == self.start.epoch else Position(epoch))
            for result in epoch_run.train(self.global_step, lambda: self.plan.last(self.global_step)):
                self.global_step += 1
                moment = self._after_step(epoch_run, result)
                if moment is not None:
                    yield moment
                    if moment.stop:
                        return
            moment = self._after_pass(epoch_run)
            yield moment
            if moment.stop:
                return

    def _after_step(self, epoch_run: EpochRun, result: Any) -> Moment | None:
        at = self.global_step
        if not self.plan.inside(epoch_run.samples) or self.plan.last(at):
            return None  # the end of the pass (or of the run) decides
        evaluate = bool(self.eval_every_steps) and at % self.eval_every_steps == 0
        save = self.checkpointer.due_after_step(at, result.stop, result.save)
        snapshot = self.checkpointer.snapshot_due()
        if not (evaluate or save or result.stop or snapshot):
            return None
        epoch_run.settle()  # the last step's agreement first: a checkpoint or an evaluation of finite weights
        return Moment(epoch_run, at, pass_end=False, evaluate=evaluate, save=save, stop=result.stop, snapshot=snapshot)

    def _after_pass(self, epoch_run: EpochRun) -> Moment:
        at, epochs_done = self.global_step, epoch_run.epoch + 1
        done = epochs_done == self.plan.epochs or self.plan.last(at)
        stopping = not done and self.stop_requested()
        evaluate = (
            epochs_done % self.eval_every == 0
            or done
            or bool(self.eval_every_steps)
            and at % self.eval_every_steps == 0
        )
        save = self.checkpointer.due_after_pass(epochs_done, at, done, stopping)
        return Moment(
            epoch_run,
            at,
            pass_end=True,
            evaluate=evaluate,
            save=save,
            stop=done or stopping,
            finished=done,
            snapshot=self.checkpointer.snapshot_due() and not done,
        )
