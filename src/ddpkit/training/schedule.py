"""The learning rate over the run: the task's own scheduler, or --lr-schedule with
--warmup-steps, --min-lr and --decay-fraction. Stepped once per optimizer step; its state
is in every checkpoint."""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import torch
from torch.optim.lr_scheduler import LambdaLR

from ..errors import DdpkitError

DEFAULT_DECAY_FRACTION = 0.2  # wsd: the last fifth of the run decays (torchtitan's and MiniCPM's usual share)


class Schedule:
    """The LR factor after optimizer step `step` (0-based): linear warm-up from 0 over `warmup`
    steps, then constant; linear or cosine down to `floor` at `total` steps; or wsd (warm-up,
    stable, decay): 1 until the last `decay_steps` steps, then linear down to `floor`.
    `floor` is --min-lr as a fraction of the learning rate. A class, not a closure, so
    LambdaLR's state_dict holds its numbers; a checkpoint written before `floor` and
    `decay_steps` existed loads its three numbers onto an instance whose others keep their
    defaults (0 floor: the old behaviour)."""

    def __init__(
        self,
        shape: str,
        warmup: int,
        total: int,
        floor: float = 0.0,
        decay_steps: int = 0,
        decay_fraction: float | None = None,
    ) -> None:
        self.shape, self.warmup, self.total = shape, warmup, max(total, 1)
        self.floor, self.decay_steps, self.decay_fraction = floor, decay_steps, decay_fraction

    def replan(self, total: int) -> None:
        """The run's planned length changed (a resume at another world size or batch, other
        --epochs/--max-steps): the same shape over the new length."""
        self.total = max(total, 1)
        if self.shape == "wsd" and getattr(self, "decay_fraction", None):
            self.decay_steps = max(1, round(self.decay_fraction * self.total))

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        if self.shape == "constant":
            return 1.0
        start = self.warmup
        if self.shape == "wsd":
            start = max(self.warmup, self.total - self.decay_steps)
            if step < start:
                return 1.0
        progress = min(1.0, (step - start) / max(1, self.total - start))
        if self.shape == "cosine":
            return self.floor + (1.0 - self.floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.floor + (1.0 - self.floor) * (1.0 - progress)  # linear, and wsd's decay


def _takes_two(fn: Callable[..., Any]) -> bool:
    """scheduler(optimizer, total_steps): a task's scheduler may ask for the run's planned length."""
    try:
        params = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
        ]
    except (TypeError, ValueError):
        return False
    return len(params) >= 2


def make_scheduler(
    task_scheduler: Callable[[torch.optim.Optimizer], Any] | None,
    shape: str,
    warmup: int,
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    min_lr: float = 0.0,
    decay_fraction: float | None = None,
) -> Any:
    """The run's LR scheduler, or None when the learning rate stays as the optimizer has it."""
    if task_scheduler is not None:
        if shape != "constant" or warmup or min_lr or decay_fraction is not None:
            raise DdpkitError(
                "the task has its own scheduler and --lr-schedule/--warmup-steps/--min-lr/--decay-fraction "
                "were given too: drop one of them"
            )
        return _task_scheduler(task_scheduler, optimizer, total_steps)
    if shape == "constant" and not warmup:
        return None
    if warmup >= total_steps and shape != "constant":
        raise DdpkitError(
            f"--warmup-steps {warmup} is not less than the run's {total_steps} optimizer steps: "
            "nothing would be left for the schedule"
        )
    lr = optimizer.param_groups[0]["lr"]
    if min_lr and not min_lr < lr:
        raise DdpkitError(
            f"--min-lr {min_lr:g} is not below the learning rate {lr:g}: the schedule would not decay; "
            "give a smaller --min-lr (nanoGPT uses lr / 10)"
        )
    fraction = DEFAULT_DECAY_FRACTION if decay_fraction is None else decay_fraction
    decay_steps = max(1, round(fraction * total_steps))
    return LambdaLR(
        optimizer,
        Schedule(
            shape,
            warmup,
            total_steps,
            floor=min_lr / lr if lr else 0.0,
            decay_steps=decay_steps,
            decay_fraction=fraction,
        ),
    )


def _task_scheduler(task_scheduler: Callable[..., Any], optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    scheduler = task_scheduler(optimizer, total_steps) if _takes_two(task_scheduler) else task_scheduler(optimizer)
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise DdpkitError(
            "the task's scheduler is ReduceLROnPlateau, which steps on a metric; ddpkit steps the scheduler "
            "after every optimizer step without one: use a step-based scheduler (LambdaLR, OneCycleLR, ...)"
        )
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise DdpkitError(
            f"the task's scheduler(optimizer) must return a torch LR scheduler "
            f"(torch.optim.lr_scheduler.LRScheduler), got {type(scheduler).__name__}"
        )
    return scheduler


def replan(scheduler: Any, total_steps: int, saved_total: int | None, say: Callable[[str], None]) -> None:
    """A resumed run's schedule follows the run as planned now: a resume at another world size
    or batch, or with other --epochs/--max-steps, changes the optimizer steps left, and a
    schedule kept at its first length would end early (a learning rate of 0 for the rest) or
    late. --lr-schedule's length is set to this plan (its shape, warm-up and floor stay the
    checkpoint's); a task's own scheduler keeps the state it saved, which is said when the
    plan changed."""
    lambdas = getattr(scheduler, "lr_lambdas", None) or []
    ours = [fn for fn in lambdas if isinstance(fn, Schedule)]
    for fn in ours:
        fn.replan(total_steps)
    if scheduler is not None and not ours and saved_total and saved_total != total_steps:
        say(
            f"ddpkit: warning: the run now plans {total_steps} optimizer steps "
            f"(it planned {saved_total} when the checkpoint "
            f"was written); the task's own scheduler resumes as it was saved, for {saved_total}"
        )
