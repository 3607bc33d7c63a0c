"""The learning rate over the run: the task's own scheduler, or --lr-schedule with
--warmup-steps. Stepped once per optimizer step; its state is in every checkpoint."""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import torch
from torch.optim.lr_scheduler import LambdaLR

from ..errors import DdpkitError


class Schedule:
    """The LR factor at optimizer step `step` (0-based): linear warm-up from 0 over `warmup`
    steps, then constant, linear to 0, or cosine to 0 at `total` steps. A class, not a
    closure, so LambdaLR's state_dict holds its numbers."""

    def __init__(self, shape: str, warmup: int, total: int) -> None:
        self.shape, self.warmup, self.total = shape, warmup, max(total, 1)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        if self.shape == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        if self.shape == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))


def _takes_two(fn: Callable[..., Any]) -> bool:
    """scheduler(optimizer, total_steps): a task's scheduler may ask for the run's planned length."""
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):
        return False
    return len(params) >= 2


def make_scheduler(task_scheduler: Callable[[torch.optim.Optimizer], Any] | None, shape: str, warmup: int,
                   optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    """The run's LR scheduler, or None when the learning rate stays as the optimizer has it."""
    if task_scheduler is not None:
        if shape != "constant" or warmup:
            raise DdpkitError("the task has its own scheduler and --lr-schedule/--warmup-steps were given too: drop one of them")
        scheduler = task_scheduler(optimizer, total_steps) if _takes_two(task_scheduler) else task_scheduler(optimizer)
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise DdpkitError("the task's scheduler is ReduceLROnPlateau, which steps on a metric; ddpkit steps the scheduler "
                              "after every optimizer step without one: use a step-based scheduler (LambdaLR, OneCycleLR, ...)")
        if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise DdpkitError(f"the task's scheduler(optimizer) must return a torch LR scheduler "
                              f"(torch.optim.lr_scheduler.LRScheduler), got {type(scheduler).__name__}")
        return scheduler
    if shape == "constant" and not warmup:
        return None
    if warmup >= total_steps and shape != "constant":
        raise DdpkitError(f"--warmup-steps {warmup} is not less than the run's {total_steps} optimizer steps: "
                          "nothing would be left for the schedule")
    return LambdaLR(optimizer, Schedule(shape, warmup, total_steps))


def replan(scheduler: Any, total_steps: int, saved_total: int | None, say: Callable[[str], None]) -> None:
    """A resumed run's schedule follows the run as planned now: a resume at another world size
    or batch, or with other --epochs/--max-steps, changes the optimizer steps left, and a
    schedule kept at its first length would end early (a learning rate of 0 for the rest) or
    late. --lr-schedule's length is set to this plan; a task's own scheduler keeps the state
    it saved, which is said when the plan changed."""
    lambdas = getattr(scheduler, "lr_lambdas", None) or []
    ours = [fn for fn in lambdas if isinstance(fn, Schedule)]
    for fn in ours:
        fn.total = max(total_steps, 1)
    if scheduler is not None and not ours and saved_total and saved_total != total_steps:
        say(f"ddpkit: warning: the run now plans {total_steps} optimizer steps (it planned {saved_total} when the checkpoint "
            f"was written); the task's own scheduler resumes as it was saved, for {saved_total}")
