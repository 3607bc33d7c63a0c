"""The run's plan and cadence as pure logic: how many epochs and steps from where a run starts
(a resume at another global batch included), and which moments evaluate, save and stop."""

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import TensorDataset

from ddpkit import DdpkitError, DistEnv, ShardedLoader
from ddpkit.checkpoint.checkpointer import Checkpointer
from ddpkit.checkpoint.state import Position
from ddpkit.config.faults import Faults
from ddpkit.runtime import Runtime
from ddpkit.training.cadence import Cadence, StepPlan


def _cfg(**kw):
    base = {"epochs": 3, "max_steps": None, "lr_schedule": "constant", "warmup_steps": 0}
    return SimpleNamespace(**{**base, **kw})


def _loader(n=90, batch=8):
    return ShardedLoader(TensorDataset(torch.arange(n)), batch)


class _Stream:
    n = None


def test_a_fresh_plan_counts_whole_passes():
    plan = StepPlan(_cfg(), _loader(), Position())
    assert (plan.epochs, plan.total_steps, plan.passes) == (3, 36, 3)  # ceil(90 / 8) = 12 steps a pass
    plan = StepPlan(_cfg(max_steps=30), _loader(), Position())
    assert (plan.epochs, plan.total_steps) == (3, 30)


def test_a_plan_from_a_resume_counts_the_steps_left_at_the_new_global_batch():
    start = Position(0, samples=40, global_step=5, global_batch=8)  # 5 steps of 8 written, resumed with 4
    plan = StepPlan(_cfg(epochs=2), _loader(batch=4), start)
    assert (plan.epochs, plan.total_steps) == (2, 5 + 13 + 23)  # ceil(50 / 4) left, then ceil(90 / 4)
    plan = StepPlan(_cfg(max_steps=12), _loader(batch=4), start)
    assert (plan.epochs, plan.total_steps) == (1, 12)  # 7 more steps fit in the resumed pass
    plan = StepPlan(_cfg(max_steps=40), _loader(batch=4), start)
    assert (plan.epochs, plan.total_steps) == (2, 40)
    done = StepPlan(_cfg(epochs=2), _loader(batch=4), Position(2, global_step=46))
    assert done.total_steps == 46  # nothing left: the schedule's length is what was done


def test_a_stream_plan_ends_with_the_stream_and_needs_max_steps_for_a_schedule():
    plan = StepPlan(_cfg(), _Stream(), Position())
    assert (plan.epochs, plan.total_steps, plan.inside(10**9)) == (3, 0, True)
    assert StepPlan(_cfg(max_steps=7), _Stream(), Position()).passes is None
    with pytest.raises(DdpkitError, match="need --max-steps"):
        StepPlan(_cfg(lr_schedule="cosine"), _Stream(), Position())


class _Pass:
    """An EpochRun's face to the cadence: `steps` optimizer steps of `per_step` samples."""

    def __init__(self, epoch, start, steps, per_step, log, stop_at=None):
        self.epoch, self.samples, self.steps, self.per_step = epoch, start.samples, steps, per_step
        self.log, self.stop_at = log, stop_at

    def train(self, global_step, until):
        for _ in range(self.steps):
            if until():
                return
            global_step += 1
            self.samples += self.per_step
            self.log.append(("step", self.epoch, global_step))
            yield SimpleNamespace(stop=global_step == self.stop_at, save=False)

    def settle(self):
        """The last step's agreement, read before a moment (nothing pending here)."""


@pytest.fixture
def rt():
    with Runtime(DistEnv(), device="cpu", threads=1) as r:
        yield r


def _faults(**when):
    """The checkpoint settings of these cases: no snapshots in memory."""
    return Faults(snapshot_every_steps=0, **when)


def _moments(rt, tmp_path, cfg, policy, start=None, stop_at=None, stop_between=False):
    start = start or Position()
    loader = _loader(n=24, batch=8)  # 3 steps a pass
    plan = StepPlan(cfg, loader, start)
    checkpointer = Checkpointer(tmp_path, rt, None, None, None, policy, {})
    log = []
    cadence = Cadence(plan, start, cfg.eval_every, cfg.eval_every_steps, checkpointer, lambda: stop_between)
    moments = [
        (m.epoch_run.epoch, m.global_step, m.pass_end, m.evaluate, m.save, m.stop, m.finished)
        for m in cadence.moments(lambda e, s: _Pass(e, s, 3, 8, log, stop_at))
    ]
    return moments, log


def test_evaluations_and_checkpoints_fall_where_the_flags_say(rt, tmp_path):
    cfg = _cfg(epochs=2, eval_every=1, eval_every_steps=2)
    moments, log = _moments(rt, tmp_path, cfg, _faults(save_every=2, save_every_steps=4))
    assert moments == [
        (0, 2, False, True, False, False, False),  # --eval-every-steps 2 inside the first pass
        (0, 3, True, True, False, False, False),  # its end: the epoch's evaluation
        (1, 4, False, True, True, False, False),  # step 4: an evaluation and --save-every-steps 4
        (1, 6, True, True, True, True, True),  # the last pass: evaluate, save (--save-every 2 and the end), done
    ]
    assert len(log) == 6


def test_max_steps_ends_the_run_at_the_end_of_its_pass_and_a_signal_ends_it_at_once(rt, tmp_path):
    cfg = _cfg(epochs=5, max_steps=4, eval_every=9, eval_every_steps=None)
    moments, log = _moments(rt, tmp_path, cfg, _faults(save_every=0))
    assert moments == [(0, 3, True, False, False, False, False), (1, 4, True, True, False, True, True)]
    assert len(log) == 4  # no fifth step, and no batch taken for it
    moments, log = _moments(
        rt, tmp_path, _cfg(epochs=5, eval_every=1, eval_every_steps=None), _faults(save_every=1), stop_at=2
    )
    assert (
        moments == [(0, 2, False, False, True, True, False)] and len(log) == 2
    )  # saved where it stopped, not finished
    moments, _ = _moments(
        rt, tmp_path, _cfg(epochs=5, eval_every=1, eval_every_steps=None), _faults(save_every=0), stop_between=True
    )
    assert moments == [(0, 3, True, True, True, True, False)]  # a signal between passes: saved at the pass's end


def test_a_run_resumed_at_max_steps_trains_nothing(rt, tmp_path):
    cfg = _cfg(epochs=5, max_steps=4, eval_every=1, eval_every_steps=None)
    moments, log = _moments(rt, tmp_path, cfg, _faults(save_every=0), start=Position(1, samples=8, global_step=4))
    assert log == [] and moments == [(1, 4, True, True, False, True, True)]
