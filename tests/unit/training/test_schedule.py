"""The learning rate over a run (training/schedule.py): warm-up, then constant, linear or
cosine to 0 at the run's last step, and what a task's own scheduler may not be."""

import math

import pytest
import torch
from torch import nn

from ddpkit import DdpkitError
from ddpkit.training.schedule import Schedule, make_scheduler


def _optimizer(lr=0.1):
    return torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=lr)


def _lrs(scheduler, optimizer, steps):
    """The learning rate each optimizer step 0..steps-1 uses (the scheduler steps after each)."""
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize(
    "shape, middle, last",
    [
        ("constant", 1.0, 1.0),
        ("linear", 0.5, 1 / 8),  # steps 2..9 go linearly from 1 to 1/8 (0 at step 10)
        ("cosine", 0.5, 0.5 * (1 + math.cos(math.pi * 7 / 8))),
    ],
)
def test_warm_up_then_the_shape_at_the_first_middle_and_last_step(shape, middle, last):
    opt = _optimizer(lr=0.1)
    lrs = _lrs(make_scheduler(None, shape, 2, opt, total_steps=10), opt, 10)
    expected = [0.1 / 3, 0.2 / 3, 0.1]  # warm-up: never 0 at the first step; full lr right after it
    assert lrs[:3] == pytest.approx(expected, rel=1e-12)
    assert lrs[6] == pytest.approx(0.1 * middle, rel=1e-12)  # half way from the end of warm-up to the end
    assert lrs[9] == pytest.approx(0.1 * last, rel=1e-12)


def test_without_warm_up_the_first_step_has_the_full_rate_and_the_factor_is_zero_at_the_end():
    for shape in ("linear", "cosine"):
        f = Schedule(shape, 0, 100)
        assert f(0) == 1.0 and f(100) == pytest.approx(0.0, abs=1e-12) and f(1000) == pytest.approx(0.0, abs=1e-12)
        assert all(f(s) >= f(s + 1) for s in range(100))  # never rises again


def test_a_constant_rate_without_warm_up_needs_no_scheduler_and_warm_up_must_leave_steps():
    assert make_scheduler(None, "constant", 0, _optimizer(), 10) is None
    with pytest.raises(DdpkitError, match="--warmup-steps 10 is not less than the run's 10 optimizer steps"):
        make_scheduler(None, "cosine", 10, _optimizer(), 10)
    constant = make_scheduler(None, "constant", 10, _optimizer(), 10)  # only a warm-up: allowed
    factor = constant.lr_lambdas[0]
    assert factor(9) == pytest.approx(10 / 11) and factor(10) == 1.0


def test_the_schedule_state_is_its_numbers():
    opt = _optimizer()
    scheduler = make_scheduler(None, "cosine", 3, opt, 20)
    _lrs(scheduler, opt, 5)
    again = make_scheduler(None, "cosine", 3, _optimizer(), 20)
    again.load_state_dict(scheduler.state_dict())  # what a checkpoint restores
    assert again.last_epoch == 5 and again.get_last_lr() == scheduler.get_last_lr()


def test_a_tasks_own_scheduler_gets_the_runs_length_when_it_asks_for_it():
    seen = []

    def with_total(optimizer, total_steps):
        seen.append(total_steps)
        return torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.0, total_iters=total_steps)

    opt = _optimizer(lr=0.1)
    scheduler = make_scheduler(with_total, "constant", 0, opt, 40)
    assert seen == [40] and _lrs(scheduler, opt, 21)[20] == pytest.approx(0.05)
    assert isinstance(
        make_scheduler(lambda o: torch.optim.lr_scheduler.StepLR(o, 5), "constant", 0, opt, 40),
        torch.optim.lr_scheduler.StepLR,
    )


@pytest.mark.parametrize(
    "scheduler, shape, warmup, fragment",
    [
        (lambda o: torch.optim.lr_scheduler.StepLR(o, 5), "cosine", 0, "drop one of them"),
        (lambda o: torch.optim.lr_scheduler.StepLR(o, 5), "constant", 3, "drop one of them"),
        (lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o), "constant", 0, "steps on a metric"),
        (lambda o: 0.5, "constant", 0, "must return a torch LR scheduler"),
    ],
)
def test_what_a_tasks_scheduler_may_not_be(scheduler, shape, warmup, fragment):
    with pytest.raises(DdpkitError, match=fragment):
        make_scheduler(scheduler, shape, warmup, _optimizer(), 40)
