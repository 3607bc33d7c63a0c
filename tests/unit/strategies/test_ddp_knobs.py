import numpy as np
import pytest
import torch

from ddpkit.strategies.ddp_knobs import fuse_optimizer, is_fused
from ddpkit.tasks import wine
from ddpkit.training.step import micro_batches


def test_wine_without_sklearn_is_bit_identical_to_sklearn():
    pytest.importorskip("sklearn")
    ours = wine._wine_arrays_without_sklearn()
    assert ours is not None
    for a, b in zip(ours, wine.wine_arrays_sklearn(), strict=True):
        assert a.shape == b.shape and np.array_equal(a, b)


def test_micro_batches_cover_the_share_in_order():
    x, y = torch.arange(10).view(5, 2), torch.arange(5)
    parts = micro_batches((x, y), 5, 3)
    assert [n for _, n in parts] == [2, 2, 1]
    assert torch.equal(torch.cat([p[0][0] for p in parts]), x)
    assert [n for _, n in micro_batches((x[:1], y[:1]), 1, 3)] == [1, 0, 0]


def test_fuse_optimizer_keeps_groups_and_hyperparameters():
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam([{"params": [m.weight], "lr": 0.1}, {"params": [m.bias]}], lr=0.01, betas=(0.8, 0.9))
    fused = fuse_optimizer(opt, "on", torch.device("cpu"))
    assert fused is not opt and fused.defaults["fused"]
    assert [g["lr"] for g in fused.param_groups] == [0.1, 0.01]
    assert fused.param_groups[1]["betas"] == (0.8, 0.9)
    assert fuse_optimizer(opt, "off", torch.device("cpu")) is opt
    assert fuse_optimizer(opt, "auto", torch.device("cpu")) is opt  # auto: GPUs only


@pytest.mark.parametrize(
    "make, fused",
    [
        (lambda p: torch.optim.AdamW(p, lr=0.01), True),
        (lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), True),
        (lambda p: torch.optim.Adam(p, lr=0.01, foreach=True), False),  # the task chose foreach
        (lambda p: torch.optim.Adam(p, lr=0.01, fused=False), False),  # the task chose: not fused
        (lambda p: torch.optim.Adam(p, lr=0.01, fused=True), True),  # already fused: kept
        (lambda p: torch.optim.RMSprop(p, lr=0.01), False),  # no fused kernel in torch
    ],
)
def test_fused_auto_is_on_for_a_gpu_where_the_task_did_not_choose(make, fused):
    """--fused-optimizer auto (the default) decides from the device's type alone: on for CUDA,
    off elsewhere; the rebuilt optimizer is made here on the CPU, where torch has the same kernels."""
    opt = make(torch.nn.Linear(3, 2).parameters())
    chosen = fuse_optimizer(opt, "auto", torch.device("cuda", 0))
    assert is_fused(chosen) is fused
    assert (chosen is opt) is (not fused or bool(opt.defaults.get("fused")))
    assert fuse_optimizer(opt, "auto", torch.device("cpu")) is opt  # off on a CPU: left as the task made it
    assert is_fused(fuse_optimizer(make(torch.nn.Linear(3, 2).parameters()), "on", torch.device("cpu"))) is (
        type(opt).__name__ != "RMSprop"  # on: overrides the task's choice where a kernel exists
    )


def test_powersgd_on_gloo_uses_one_bucket():
    # several buckets' PowerSGD all-reduces interleave differently per rank on gloo (a
    # collective mismatch seen on the 9.5M MLP); one bucket keeps them ordered
    from ddpkit.parallel.spec import StrategyConfig
    from ddpkit.strategies.ddp_knobs import ddp_options

    assert ddp_options(StrategyConfig(grad_compression="powersgd"), "gloo")["bucket_cap_mb"] >= 1 << 20
    assert "bucket_cap_mb" not in ddp_options(StrategyConfig(grad_compression="powersgd"), "nccl")
    assert ddp_options(StrategyConfig(bucket_mb=5, static_graph=True), "gloo") == {
        "bucket_cap_mb": 5.0,
        "static_graph": True,
    }


def test_shared_memory_all_reduce_applies_only_to_cpu_ranks_of_one_machine():
    from ddpkit.runtime.shm import why_not_shm

    assert why_not_shm(2, 2, "gloo", "cpu") is None
    assert why_not_shm(8, 8, "gloo", "cpu") is None
    assert "one process" in why_not_shm(1, 1, "gloo", "cpu")
    assert "several machines" in why_not_shm(4, 2, "gloo", "cpu")
    assert "backend's own all-reduce" in why_not_shm(2, 2, "nccl", "cuda")


@pytest.mark.parametrize(
    "kw, fragment",
    [
        (dict(grad_sync="shm", grad_compression="fp16"), "cannot carry --grad-compression fp16"),
        (dict(grad_sync="tcp"), "--grad-sync must be one of"),
        (dict(grad_sync="shm", strategy="fsdp", nproc=2), "--grad-sync shm: DDP options"),
    ],
)
def test_grad_sync_config_refusals(kw, fragment):
    from ddpkit.config import RunConfig
    from ddpkit.errors import DdpkitError

    with pytest.raises(DdpkitError, match=fragment):
        RunConfig(**kw)
