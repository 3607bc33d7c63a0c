"""--deterministic (runtime/determinism.py): torch's switches on within the block and put back
after it, and the built-in tasks and the GPT example train under them on a CPU (an op without
a deterministic kernel would raise here)."""

import os

import pytest
import torch

from conftest import REPO
from ddpkit.runtime.determinism import CUBLAS_WORKSPACE, deterministic
from ddpkit.task import as_task, build_task
from ddpkit.tasks import digits, wine
from ddpkit.training.batches import compute_loss

CUBLAS = "CUBLAS_WORKSPACE_CONFIG"


def _switches():
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )


def test_the_switches_are_on_inside_and_put_back_after(monkeypatch):
    monkeypatch.delenv(CUBLAS, raising=False)
    before = _switches()
    assert before[0] is False
    with deterministic(True):
        assert _switches() == (True, True, False)
        assert os.environ[CUBLAS] == CUBLAS_WORKSPACE == ":4096:8"
    assert _switches() == before and CUBLAS not in os.environ
    monkeypatch.setenv(CUBLAS, ":16:8")  # the other deterministic value, the user's: kept
    with deterministic(True):
        assert os.environ[CUBLAS] == ":16:8"
    with deterministic(False):
        assert _switches() == before


def _gpt():
    return build_task(f"{REPO / 'examples' / 'gpt.py'}:build", None, {"max_samples": 16})


@pytest.mark.parametrize("build", [wine.build, digits.build, _gpt], ids=["wine", "digits", "gpt"])
def test_the_built_in_tasks_and_the_gpt_example_train_under_it(build):
    with deterministic(True):
        torch.manual_seed(0)
        task = as_task(build(), "test")
        opt = task.optimizer(task.model.parameters()) if callable(task.optimizer) else task.optimizer
        batch = torch.utils.data.default_collate([task.train_set[i] for i in range(4)])
        for _ in range(2):  # forward, backward and the optimizer step as the loop makes them
            loss = compute_loss(task.model, batch, 4, task.loss_fn, task.step, torch.device("cpu")).value
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert torch.isfinite(loss)
