"""One optimizer step (training/step.py) on one process: micro-batches weighted to equal the
whole batch, the NaN policy, and the batch-shape error."""

import pytest
import torch
from torch import nn

from ddpkit import DdpkitError, DistEnv
from ddpkit.runtime import Runtime
from ddpkit.strategies import DdpStrategy
from ddpkit.training.step import StepRunner, micro_batches


@pytest.fixture
def rt():
    with Runtime(DistEnv(), device="cpu", threads=1) as r:
        yield r


def _runner(rt, accumulate=1, on_nan="stop"):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    return StepRunner(rt, DdpStrategy(rt), model, opt, nn.CrossEntropyLoss(), accumulate, on_nan)


def _batch(n=7):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g)


def test_micro_batches_sum_to_the_whole_batch_step(rt):
    whole, split = _runner(rt), _runner(rt, accumulate=3)
    r1 = whole.run(_batch(), 7, 7, "epoch 1, step 1")
    r3 = split.run(_batch(), 7, 7, "epoch 1, step 1")
    assert r1.loss_sum[1].item() == r3.loss_sum[1].item() == 7  # [loss sum, samples]
    assert r1.loss_sum[0].item() == pytest.approx(r3.loss_sum[0].item(), rel=1e-6)  # float32 means of other sizes
    for a, b in zip(whole.model.parameters(), split.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_micro_batch_sizes_differ_by_at_most_one_and_the_last_may_be_empty():
    x, y = _batch(5)
    assert [n for _, n in micro_batches((x, y), 5, 3)] == [2, 2, 1]
    assert [n for _, n in micro_batches((x[:2], y[:2]), 2, 3)] == [1, 1, 0]


def test_a_nan_loss_stops_before_the_weights_change_naming_the_step(rt):
    runner = _runner(rt)
    before = [p.detach().clone() for p in runner.model.parameters()]
    x, y = _batch()
    x[2, 0] = float("nan")
    with pytest.raises(DdpkitError, match="not finite in epoch 2, step 5 .*--on-nan skip"):
        runner.run((x, y), 7, 7, "epoch 2, step 5")
    assert all(torch.equal(a, b) for a, b in zip(before, runner.model.parameters(), strict=True))
    runner.finite_checkpoint = lambda: "run/checkpoints/epoch-000001.pt"  # what the checkpointer saw finite
    with pytest.raises(DdpkitError, match=r"epoch-000001\.pt holds finite weights \(checked when it was written"):
        runner.run((x, y), 7, 7, "epoch 2, step 5")


def test_on_nan_skip_drops_the_step_and_its_gradients(rt):
    runner = _runner(rt, accumulate=2, on_nan="skip")
    before = [p.detach().clone() for p in runner.model.parameters()]
    x, y = _batch()
    x[0, 0] = float("inf")  # in the first micro-batch: its gradient must not leak into the next step
    assert runner.run((x, y), 7, 7, "epoch 1, step 1").loss_sum is None
    assert all(torch.equal(a, b) for a, b in zip(before, runner.model.parameters(), strict=True))
    assert all(p.grad is None for p in runner.model.parameters())


def test_an_item_that_is_not_inputs_and_target_is_named(rt):
    with pytest.raises(
        DdpkitError, match=r"must be a dict \(passed to the model as keyword arguments\) or \(inputs..., target\)"
    ):
        _runner(rt).run(torch.randn(4, 3), 4, 4, "epoch 1, step 1")
