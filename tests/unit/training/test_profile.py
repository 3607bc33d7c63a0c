"""DDPKIT_PROFILE_STEPS (training/profile.py): the chosen global steps, as whole loop
iterations, under torch.profiler, with the step's parts labelled; the variables' checks."""

import json

import pytest
import torch
from torch import nn
from torch.profiler import record_function

from ddpkit import DdpkitError, DistEnv
from ddpkit.runtime import Runtime
from ddpkit.strategies import DdpStrategy
from ddpkit.training.profile import LabelledSteps, StepProfile, steps_from_env


@pytest.fixture
def rt():
    with Runtime(DistEnv(), device="cpu", threads=1) as r:
        yield r


def _train(rt, profile, passes):
    """Passes of (x, y) batches through a LabelledSteps runner, as EpochRun iterates them,
    with the loop's bookkeeping after each step stood in for by an `after` label."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    runner = LabelledSteps(rt, DdpStrategy(rt), model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss())
    done = 0
    for n in passes:
        batches = iter([(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(n)])
        for batch in profile.around(batches, done):
            runner.run(batch, 4, 4, f"step {done + 1}")
            done += 1
            with record_function("after"):
                torch.ones(3).sum()
    profile.close(reached=done)
    return done


def _steps(trace):
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]

    def within(step):
        return {e["name"] for e in events if step["ts"] <= e["ts"] < step["ts"] + step["dur"]}

    return [within(s) for s in steps]


def test_the_chosen_steps_are_whole_loop_iterations_across_a_pass_boundary(rt, tmp_path):
    _train(rt, StepProfile(rt, 2, 5, tmp_path), passes=[3, 3])  # steps 2, 3 | 4 profiled; 1 is the warm-up
    steps = _steps(json.loads((tmp_path / "rank0.json").read_text()))
    assert len(steps) == 3
    for names in steps:  # the fetch, the step's parts and the bookkeeping after it, in each
        assert {"step.data", "step.run", "step.forward", "step.backward", "step.optimizer", "after"} <= names
    header, table = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    assert json.loads(header)["steps"] == [2, 5] and "aten::addmm" in table


def test_a_run_that_ends_before_the_steps_writes_nothing_and_says_so(rt, tmp_path, capsys):
    _train(rt, StepProfile(rt, 10, 12, tmp_path / "prof"), passes=[3])
    assert not (tmp_path / "prof").exists()
    assert "DDPKIT_PROFILE_STEPS=10:12: the run ended at step 3" in capsys.readouterr().out


def test_the_variables_are_checked():
    assert steps_from_env({}) is None
    assert steps_from_env({"DDPKIT_PROFILE_STEPS": "3:7", "DDPKIT_PROFILE_OUT": "d"})[:2] == (3, 7)
    for steps in ("3", "0:4", "5:5", "a:b"):
        with pytest.raises(DdpkitError, match="give A:B"):
            steps_from_env({"DDPKIT_PROFILE_STEPS": steps, "DDPKIT_PROFILE_OUT": "d"})
    with pytest.raises(DdpkitError, match="go together"):
        steps_from_env({"DDPKIT_PROFILE_STEPS": "3:7"})
