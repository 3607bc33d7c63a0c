"""--strategy auto and the plan's advice (strategies/choice.py): the fastest candidate whose peak,
everything counted, fits; the order DDP, HSDP, FSDP, then checkpointing, then a smaller micro-batch."""

from __future__ import annotations

import torch
from torch import nn

from ddpkit.parallel.spec import StrategyConfig
from ddpkit.planning.memory import make_plan
from ddpkit.planning.peak import ActivationEstimate
from ddpkit.planning.process import ProcessCost
from ddpkit.strategies.choice import FIT_FRACTION, micro_batches
from ddpkit.strategies.fsdp import default_blocks

MiB = 2**20


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(512, 512) for _ in range(8))  # ~2 MiB each

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


# 8 samples keep 80 MiB (10 per sample); checkpointed 16 MiB + 8 MiB while a block is recomputed
ACT = ActivationEstimate(8, 80 * MiB, 16 * MiB, 8 * MiB, per_sample=(10 * MiB, 2 * MiB, MiB))


def plan(budget: float, world: int = 4, fixed: int = 100 * MiB, act: ActivationEstimate | None = ACT, **kw):
    return make_plan(
        Net(),
        lambda p: torch.optim.Adam(p),
        world,
        "fp32",
        int(budget),
        "test",
        default_blocks,
        activations=act,
        process=ProcessCost(fixed, 0, "test"),
        **kw,
    )


def peak_of(p, strategy: str, ckpt: bool = False, batch: int | None = None) -> int:
    return p.peak(strategy, ckpt, batch).total


def test_the_peak_counts_fixed_cost_state_in_flight_activations_and_rank_0s_end():
    p = plan(10**12)
    ddp, fsdp = p.peak("ddp"), p.peak("fsdp")
    assert ddp.fixed == 100 * MiB and ddp.state == p.ddp.state and ddp.activations == 88 * MiB
    assert ddp.training == 100 * MiB + p.ddp.state + 88 * MiB and ddp.total == ddp.training
    assert fsdp.transient == p.fsdp.transient > 0
    # rank 0 writes model.pt gathering one tensor at a time beside its shards (its gradients are freed)
    assert fsdp.end_of_run == p.fsdp.params + p.fsdp.optimizer + 512 * 512 * 4  # one whole tensor at a time
    assert p.peak("ddp", True).activations == 16 * MiB + 2 * 8 * MiB
    assert p.peak("ddp", batch_size=4).activations == 40 * MiB + 4 * MiB


def test_auto_takes_ddp_whole_when_everything_fits():
    c = plan(10**12).choice()
    assert (c.strategy, c.checkpointing, c.batch_size, c.accumulate) == ("ddp", False, 8, 1)
    assert c.fits and c.line.startswith("ddp: DDP needs") and "the fastest" in c.line


def test_auto_shards_before_it_recomputes_and_recomputes_before_it_cuts_the_micro_batch():
    base = plan(10**12)
    # DDP does not fit, FSDP does: FSDP, no checkpointing
    budget = (peak_of(base, "fsdp") + peak_of(base, "ddp")) / 2 / FIT_FRACTION
    c = plan(budget).choice()
    assert (c.strategy, c.checkpointing, c.batch_size) == ("fsdp", False, 8)
    assert "DDP needs" in c.line and "more than" in c.line and "FSDP x4 needs" in c.line
    # neither fits whole, but DDP with checkpointing does
    budget = (peak_of(base, "ddp", True) + peak_of(base, "fsdp")) / 2 / FIT_FRACTION
    assert peak_of(base, "ddp", True) < peak_of(base, "fsdp")
    c = plan(budget).choice()
    assert (c.strategy, c.checkpointing, c.batch_size) == ("ddp", True, 8)
    assert "DDP + activation checkpointing needs" in c.line


def test_a_smaller_micro_batch_keeps_the_global_batch_by_accumulating_more():
    base = plan(10**12, world=1)
    need = peak_of(base, "ddp", True, 2)
    c = plan((need + peak_of(base, "ddp", True, 4)) / 2 / FIT_FRACTION, world=1).choice(8, 3)
    assert (c.strategy, c.checkpointing, c.batch_size, c.accumulate) == ("ddp", True, 2, 12)  # 8 x 3 = 2 x 12
    assert c.settings() == {"strategy": "ddp", "activation_checkpointing": True, "batch_size": 2, "accumulate": 12}
    assert "at --batch-size 2 --accumulate 12" in c.line
    fixed = plan((need + peak_of(base, "ddp", True, 4)) / 2 / FIT_FRACTION, world=1).choice(8, 3, fixed_global=True)
    assert fixed.accumulate is None and "accumulate" not in fixed.settings()  # --global-batch-size recomputes it
    assert micro_batches(12) == [12, 6, 4, 3, 2, 1]


def test_the_fixed_cost_alone_can_decide():
    base = plan(10**12, fixed=0)
    budget = (peak_of(base, "ddp") + 50 * MiB) / FIT_FRACTION
    whole = plan(budget, fixed=0).choice()
    assert (whole.strategy, whole.checkpointing) == ("ddp", False)
    counted = plan(budget, fixed=100 * MiB).choice()
    assert (counted.strategy, counted.checkpointing) != ("ddp", False) and counted.fits


def test_when_nothing_fits_the_least_is_taken_and_said():
    c = plan(MiB).choice()
    assert not c.fits and "nothing fits" in c.line and "expect out-of-memory" in c.line
    assert (c.strategy, c.checkpointing, c.batch_size) == ("fsdp", True, 1)


def test_when_nothing_fits_the_least_is_the_one_more_processes_help_not_the_one_with_fewer_imports():
    """FSDP's modules cost a few MiB once (measured, noisy): where nothing fits, they decided the
    advice between DDP and FSDP on a model whose state FSDP quarters. No setting removes the fixed
    cost; the least is the one whose own part is smallest, which more processes shrink."""
    p = make_plan(
        Net(), lambda q: torch.optim.Adam(q), 4, "fp32", MiB, "test", default_blocks,
        activations=None, process=ProcessCost(100 * MiB, 40 * MiB, "test"),
    )  # fmt: skip
    ddp, fsdp = p.peak("ddp"), p.peak("fsdp")
    assert fsdp.total > ddp.total and fsdp.total - fsdp.fixed < ddp.total - ddp.fixed  # the case
    c = p.choice()
    assert not c.fits and c.strategy == "fsdp" and "the least, FSDP x4" in c.line


def test_one_process_has_only_ddp_and_a_knob_fsdp_refuses_keeps_ddp():
    assert plan(MiB, world=1).choice().strategy == "ddp"
    base = plan(10**12)
    budget = (peak_of(base, "fsdp") + peak_of(base, "ddp")) / 2 / FIT_FRACTION
    knobbed = plan(budget).choice(config=StrategyConfig(name="auto", bucket_mb=10))
    assert knobbed.strategy == "ddp" and knobbed.checkpointing  # FSDP takes no --bucket-mb


def test_across_nodes_hsdp_comes_before_fsdp():
    base = plan(10**12, nnodes=2)
    budget = (peak_of(base, "ddp") + peak_of(base, "hsdp")) / 2 / FIT_FRACTION
    assert peak_of(base, "hsdp") < peak_of(base, "ddp")
    c = plan(budget, nnodes=2).choice()
    assert c.strategy == "hsdp" and "HSDP 2x2 needs" in c.line


def test_without_an_activation_estimate_only_the_strategies_are_compared():
    c = plan(10**12, act=None).choice()
    assert (c.strategy, c.checkpointing, c.batch_size) == ("ddp", False, None)
    assert c.settings() == {"strategy": "ddp", "activation_checkpointing": False}
