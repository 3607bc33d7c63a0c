"""Rebuilding a task's optimizer over new parameters (FSDP's shards) or with fused kernels:
same class, same groups and settings, for every torch optimizer (torch 2.13's AdamW lists
`decoupled_weight_decay` in its defaults, which its constructor does not take)."""

import pytest
import torch
from torch import nn

from ddpkit import DdpkitError
from ddpkit.strategies.ddp_knobs import fuse_optimizer
from ddpkit.strategies.optimizers import make_optimizer, rebuild_optimizer


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


OPTIMIZERS = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.05, betas=(0.8, 0.95)),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=2e-3, amsgrad=True),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "AdamW-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "Adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True),
    "SGD-fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2),
}


def _groups(model, make):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    other = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    opt = make(decay)
    opt.add_param_group({"params": other, "weight_decay": 0.0})
    return opt


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_rebuild_keeps_class_groups_and_settings_over_new_parameters(name):
    old, new = _model(), _model()
    opt = _groups(old, OPTIMIZERS[name])
    swap = dict(zip(map(id, old.parameters()), new.parameters(), strict=True))
    rebuilt = rebuild_optimizer(opt, lambda p: swap[id(p)])
    assert type(rebuilt) is type(opt)
    assert len(rebuilt.param_groups) == 2
    for a, b in zip(opt.param_groups, rebuilt.param_groups, strict=True):
        assert {k: v for k, v in a.items() if k != "params"} == {k: v for k, v in b.items() if k != "params"}
        assert [id(swap[id(p)]) for p in a["params"]] == [id(p) for p in b["params"]]
    # it steps like the original: the same inputs move both (equal) models to equal parameters
    for step in range(3):
        for model, optimizer in ((old, opt), (new, rebuilt)):
            torch.manual_seed(step)
            model(torch.randn(3, 4)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(old.parameters(), new.parameters(), strict=True):
        assert torch.equal(a, b)  # the same arithmetic in the same order
    assert not torch.equal(next(new.parameters()), next(_model().parameters()))  # and it did step


@pytest.mark.parametrize("name", ["AdamW", "Adam", "SGD"])
def test_fused_on_rebuilds_the_same_optimizer_with_the_fused_kernel_and_the_same_steps(name):
    ref_model, model = _model(), _model()
    ref = _groups(ref_model, OPTIMIZERS[name])
    fused = fuse_optimizer(_groups(model, OPTIMIZERS[name]), "on", torch.device("cpu"))
    assert type(fused) is type(ref) and all(g["fused"] for g in fused.param_groups)
    for _ in range(3):
        for m, o in ((ref_model, ref), (model, fused)):
            torch.manual_seed(1)
            m(torch.randn(5, 4)).square().mean().backward()
            o.step()
            o.zero_grad()
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_an_optimizer_whose_constructor_refuses_its_settings_gets_a_clear_error():
    class Picky(torch.optim.SGD):
        def __init__(self, params, lr=0.1):
            super().__init__(params, lr=lr)
            if len(self.param_groups) > 0 and any("weight_decay" in g and g["weight_decay"] for g in self.param_groups):
                raise ValueError("no weight decay here")

    model = _model()
    opt = Picky(model.parameters())
    opt.param_groups[0]["weight_decay"] = 0.1
    with pytest.raises(DdpkitError, match="could not rebuild the task's Picky .*optimizer=lambda params"):
        rebuild_optimizer(opt)


def test_make_optimizer_applies_lr_and_refuses_a_foreign_optimizer():
    model = _model()
    assert make_optimizer(lambda ps: torch.optim.SGD(ps, lr=1.0), model, 0.25).param_groups[0]["lr"] == 0.25
    with pytest.raises(DdpkitError, match="does not optimise the task's model"):
        make_optimizer(torch.optim.SGD(_model().parameters(), lr=1.0), model, None)
