"""The Strategy face the loop uses, on one process (several ranks: tests/distributed/test_fsdp.py)."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddpkit import DdpkitError, DistEnv, RunConfig, Task
from ddpkit.runtime import Runtime
from ddpkit.strategies import DdpStrategy, make_strategy


@pytest.fixture
def rt():
    with Runtime(DistEnv(), device="cpu", threads=1) as r:
        yield r


def _task():
    torch.manual_seed(0)
    x, y = torch.randn(10, 4), torch.randint(0, 2, (10,))
    return Task(model=nn.Linear(4, 2), train_set=TensorDataset(x, y), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))


def _setup(strategy):
    task = _task()
    model = strategy.setup_module(task.model)
    return model, strategy.setup_optimizer(task.optimizer, model)


def test_ddp_on_one_process_leaves_the_model_as_it_is(rt):
    strategy = make_strategy(RunConfig(nproc=1), rt, task := _task())
    model = strategy.setup_module(task.model)
    opt = strategy.setup_optimizer(task.optimizer, model, lr=0.5)
    assert isinstance(strategy, DdpStrategy) and model is task.model and opt.param_groups[0]["lr"] == 0.5
    assert strategy.grad_sync(model) == "none" and strategy.eval_module(model) is model


def test_clip_grad_norm_returns_the_norm_before_clipping_and_clips_to_max(rt):
    strategy = DdpStrategy(rt)
    model = nn.Linear(4, 3)
    model(torch.randn(8, 4)).pow(2).sum().backward()
    before = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])).item()
    assert strategy.clip_grad_norm(model, 0.5) == pytest.approx(before, rel=1e-6) and before > 0.5
    after = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])).item()
    assert after == pytest.approx(0.5, rel=1e-5)


def test_fsdp_needs_two_ranks(rt):
    with pytest.raises(DdpkitError, match="needs at least 2"):
        make_strategy(RunConfig(strategy="fsdp", nproc=2), rt, _task())  # the job turned out to have one rank


def test_bf16_on_a_gpu_below_compute_capability_8_is_refused_even_where_torch_would_emulate_it(monkeypatch):
    from ddpkit.strategies.precision import check_precision

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)  # torch's answer includes emulation
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))  # a V100
    with pytest.raises(DdpkitError, match="this GPU has no bfloat16 support"):
        check_precision("bf16", "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100
    assert check_precision("bf16", "cuda") is torch.bfloat16
