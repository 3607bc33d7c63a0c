"""--lr-schedule, --warmup-steps, --min-lr and --decay-fraction: the learning rate the optimizer
holds after each optimizer step equals the written-out formula at the first, middle and last
steps, and an old checkpoint's scheduler state (before the floor existed) still loads."""

import math

import pytest
import torch

from ddpkit.config import RunConfig
from ddpkit.errors import DdpkitError
from ddpkit.training.schedule import make_scheduler

LR, MIN_LR, TOTAL, WARMUP = 0.1, 0.01, 20, 4


def _lrs(shape, warmup=WARMUP, min_lr=MIN_LR, total=TOTAL, decay_fraction=None, groups=(LR,)):
    """[lr before any step, lr after step 1, ..., lr after step `total`] of the first group (and all groups' last)."""
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in groups]
    opt = torch.optim.SGD([{"params": [p], "lr": g} for p, g in zip(params, groups, strict=True)], lr=groups[0])
    sched = make_scheduler(None, shape, warmup, opt, total, min_lr, decay_fraction)
    out = [opt.param_groups[0]["lr"]]
    for _ in range(total):
        opt.step()
        sched.step()
        out.append(opt.param_groups[0]["lr"])
    return out, [g["lr"] for g in opt.param_groups]


def warm(step):
    return LR * (step + 1) / (WARMUP + 1)


def cosine(step):
    t = (step - WARMUP) / (TOTAL - WARMUP)
    return MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * t))


def linear(step):
    return MIN_LR + (LR - MIN_LR) * (1 - (step - WARMUP) / (TOTAL - WARMUP))


@pytest.mark.parametrize("shape, formula", [("cosine", cosine), ("linear", linear)])
def test_cosine_and_linear_decay_to_min_lr(shape, formula):
    lrs, _ = _lrs(shape)
    assert lrs[0] == pytest.approx(warm(0))  # first step: warming up from 0
    assert lrs[WARMUP] == pytest.approx(LR)  # warm-up done: the full learning rate
    assert lrs[12] == pytest.approx(formula(12))  # the middle of the decay
    assert lrs[12] == pytest.approx(MIN_LR + (LR - MIN_LR) / 2)  # half way, both shapes are half way down
    assert lrs[TOTAL] == pytest.approx(MIN_LR)  # the last step: the floor, not 0
    assert min(lrs[WARMUP:]) == pytest.approx(MIN_LR)


def test_without_min_lr_the_schedules_still_end_at_zero():
    assert _lrs("cosine", min_lr=0.0)[0][TOTAL] == pytest.approx(0.0, abs=1e-12)
    assert _lrs("linear", min_lr=0.0)[0][12] == pytest.approx(LR / 2)


def test_wsd_is_stable_then_decays_linearly_over_the_last_fraction():
    lrs, _ = _lrs("wsd", decay_fraction=0.25)  # 20 steps: the last 5 decay
    assert lrs[0] == pytest.approx(warm(0))
    assert lrs[WARMUP] == lrs[10] == lrs[15] == pytest.approx(LR)  # stable through step 15
    assert lrs[16] == pytest.approx(MIN_LR + (LR - MIN_LR) * (1 - 1 / 5))
    assert lrs[18] == pytest.approx(MIN_LR + (LR - MIN_LR) * (1 - 3 / 5))  # the middle of the decay
    assert lrs[TOTAL] == pytest.approx(MIN_LR)


def test_wsd_default_decay_fraction_is_a_fifth():
    lrs, _ = _lrs("wsd", warmup=0, min_lr=0.0)  # the last 4 of 20 steps decay, to 0
    assert lrs[:17] == pytest.approx([LR] * 17)
    assert lrs[18] == pytest.approx(LR / 2) and lrs[TOTAL] == pytest.approx(0.0, abs=1e-12)


def test_other_parameter_groups_end_at_the_same_fraction_of_their_lr():
    _, last = _lrs("cosine", groups=(LR, LR / 4))
    assert last == pytest.approx([MIN_LR, MIN_LR / 4])


def test_a_scheduler_state_from_before_the_floor_loads_and_keeps_decaying_to_zero():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = make_scheduler(None, "cosine", WARMUP, opt, TOTAL)
    for _ in range(6):
        opt.step()
        sched.step()
    state = sched.state_dict()
    state["_lr_lambdas"] = [{"shape": "cosine", "warmup": WARMUP, "total": TOTAL}]  # what older checkpoints hold
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    resumed = make_scheduler(None, "cosine", WARMUP, opt2, TOTAL)
    resumed.load_state_dict(state)
    for _ in range(TOTAL - 6):
        opt2.step()
        resumed.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"min_lr": 0.01}, "--min-lr is where --lr-schedule linear, cosine or wsd ends"),
        ({"min_lr": -1.0, "lr_schedule": "cosine"}, "--min-lr must be 0 or a positive"),
        ({"min_lr": 0.5, "lr": 0.1, "lr_schedule": "cosine"}, "--min-lr 0.5 must be below --lr 0.1"),
        ({"decay_fraction": 0.3, "lr_schedule": "cosine"}, "--decay-fraction sets the decay of --lr-schedule wsd"),
        ({"decay_fraction": 0.0, "lr_schedule": "wsd"}, "--decay-fraction must be in (0, 1]"),
        ({"decay_fraction": 1.5, "lr_schedule": "wsd"}, "--decay-fraction must be in (0, 1]"),
    ],
)
def test_bad_schedule_settings_are_refused(kwargs, fragment):
    with pytest.raises(DdpkitError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        RunConfig(**kwargs)


def test_a_min_lr_not_below_the_tasks_own_lr_is_refused():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    with pytest.raises(DdpkitError, match="--min-lr 0.2 is not below the learning rate 0.1"):
        make_scheduler(None, "cosine", 0, opt, TOTAL, min_lr=0.2)
    with pytest.raises(DdpkitError, match="own scheduler"):
        make_scheduler(lambda o: torch.optim.lr_scheduler.StepLR(o, 2), "constant", 0, opt, TOTAL, min_lr=0.01)


def test_a_replanned_wsd_schedule_keeps_its_decay_fraction_over_the_new_length():
    from ddpkit.training.schedule import replan

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make_scheduler(None, "wsd", 0, opt, 100, min_lr=0.1, decay_fraction=0.25)
    said = []
    replan(sched, 40, 100, said.append)
    (fn,) = sched.lr_lambdas
    assert (fn.total, fn.decay_steps) == (40, 10) and not said  # ours is re-planned, nothing to say
    assert fn(29) == 1.0 and fn(30) == pytest.approx(1.0) and fn(40) == pytest.approx(0.1)
