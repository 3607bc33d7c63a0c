"""The loss of one micro-batch (training/batches.py: compute_loss) for every batch shape and
loss source a task can have, in their order: step hook, loss_fn, the loss the output
carries, cross-entropy."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ddpkit import DdpkitError
from ddpkit.training.batches import compute_loss

CPU = torch.device("cpu")


def _data(n=5):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g)


def _model():
    torch.manual_seed(0)
    return nn.Linear(3, 2)


class Carries(nn.Module):
    """A model whose output carries its loss, as Hugging Face (`.loss`) or nanoGPT (`(logits, loss)`) do."""

    def __init__(self, how):
        super().__init__()
        self.linear, self.how = _model(), how

    def forward(self, x, y=None):
        logits = self.linear(x)
        loss = nn.functional.cross_entropy(logits, y) * 3  # not what cross-entropy alone gives
        if self.how == "attribute":
            return SimpleNamespace(logits=logits, loss=loss)
        return {"logits": logits, "loss": loss} if self.how == "key" else (logits, loss)


def test_a_tuple_batch_without_loss_fn_is_cross_entropy_of_inputs_and_target():
    x, y = _data()
    model = _model()
    loss = compute_loss(model, (x, y), 5, None, None, CPU)
    assert torch.equal(loss.value, nn.functional.cross_entropy(model(x), y))
    assert loss.count.dtype == torch.float64 and loss.count.item() == 5 and not loss.summed


def test_loss_fn_wins_over_a_carried_loss():
    x, y = _data()
    model = Carries("tuple")
    loss = compute_loss(model, (x, y, y), 5, lambda out, target: out[0].sum() * 0 + 7.0, None, CPU)
    assert loss.value.item() == 7.0


@pytest.mark.parametrize("how", ["attribute", "key", "tuple"])
def test_the_loss_the_output_carries_is_used(how):
    x, y = _data()
    model = Carries(how)
    expected = nn.functional.cross_entropy(model.linear(x), y) * 3
    assert torch.equal(compute_loss(model, {"x": x, "y": y}, 5, None, None, CPU).value, expected)  # model(**batch)
    assert torch.equal(compute_loss(model, (x, y, y), 5, None, None, CPU).value, expected)  # model(x, y), target y


def test_a_step_hook_returning_a_sum_and_a_count_is_summed_over_that_count():
    x, y = _data()
    model = _model()

    def step(m, batch):
        return nn.functional.cross_entropy(m(batch[0]), batch[1], reduction="sum"), 12  # e.g. 12 real tokens

    loss = compute_loss(model, (x, y), 5, nn.MSELoss(), step, CPU)  # the hook wins over loss_fn
    assert loss.summed and loss.count.dtype == torch.float64 and loss.count.item() == 12
    assert torch.allclose(loss.value, nn.functional.cross_entropy(model(x), y) * 5)
    mean = compute_loss(model, (x, y), 5, None, lambda m, b: m(b[0]).mean(), CPU)
    assert not mean.summed and mean.count.item() == 5


def test_an_empty_micro_batch_has_no_loss_and_counts_nothing():
    x, y = _data(0)
    loss = compute_loss(_model(), (x, y), 0, None, None, CPU)
    assert loss.value is None and loss.count.item() == 0 and loss.output.shape == (0, 2)  # the output joins the sync


@pytest.mark.parametrize(
    "batch, loss_fn, step, fragment",
    [
        (torch.zeros(4, 3), None, None, "must be a dict .* or \\(inputs..., target\\); got Tensor"),
        ({"x": torch.zeros(4, 3)}, None, None, "carries no loss"),
        (
            (torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)),
            None,
            lambda m, b: (1, 2, 3),
            "must return the loss, or",
        ),
        (
            (torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)),
            None,
            lambda m, b: m(b[0]),
            "must return a scalar tensor",
        ),
    ],
)
def test_what_cannot_be_a_loss_is_explained(batch, loss_fn, step, fragment):
    model = _model() if not isinstance(batch, dict) else (lambda x: x * 2)
    with pytest.raises(DdpkitError, match=fragment):
        compute_loss(model, batch, 4, loss_fn, step, CPU)
