"""The strategy's typed settings and its one rule book: the same refusals, spelled as flags for
the CLI and as rt.wrap's keywords for an own loop, whoever asks (config, launcher, Session)."""

import re

import pytest
from torch import nn

from ddpkit import DdpkitError, DistEnv, RunConfig
from ddpkit.ownloop.session import Session
from ddpkit.parallel.spec import (
    FSDP_NEEDS_TWO,
    StrategyConfig,
    check,
    fsdp_mesh,
    fsdp_note,
    hsdp_mesh,
    hsdp_note,
    strategy_spec,
)
from ddpkit.run.train import _check_strategy

FSDP = StrategyConfig(name="fsdp")


def test_run_config_builds_the_typed_strategy_settings_once():
    cfg = RunConfig(
        strategy="ddp",
        precision="bf16",
        device_memory="2GiB",
        grad_sync="backend",
        grad_compression="fp16",
        bucket_mb=5,
        static_graph=True,
        fused_optimizer="on",
        compile=True,
        async_save=True,
    )
    assert cfg.strategy_config() == StrategyConfig(
        name="ddp",
        precision="bf16",
        device_memory=2 << 30,
        async_save=True,
        grad_sync="backend",
        grad_compression="fp16",
        bucket_mb=5,
        static_graph=True,
        fused_optimizer="on",
        compile=True,
    )
    assert RunConfig().strategy_config() == StrategyConfig()  # the defaults agree


@pytest.mark.parametrize(
    "config, world, message",
    [
        (StrategyConfig(name="zero3"), None, "--strategy must be one of ddp, fsdp, hsdp, auto, got 'zero3'"),
        (FSDP, 1, FSDP_NEEDS_TWO),
        (
            StrategyConfig(name="fsdp", compile=True, bucket_mb=4.0, static_graph=True),
            2,
            "--bucket-mb, --static-graph: DDP options, not available with --strategy fsdp; drop them or use "
            "--strategy ddp",
        ),
        (StrategyConfig(name="fsdp", grad_sync="shm"), None, "--grad-sync shm: DDP options"),
        (StrategyConfig(name="fsdp", fused_optimizer="on"), 4, "--fused-optimizer on: DDP options"),
        (StrategyConfig(name="fsdp", precision="fp16"), 2, "--precision fp16 needs a gradient scaler"),
        (StrategyConfig(name="auto", async_save=True), 2, "--async-save writes DDP's one-file checkpoints"),
        (StrategyConfig(name="fsdp", async_save=True), 2, "drop --async-save with --strategy fsdp/auto"),
    ],
)
def test_check_refuses_with_the_flags_named(config, world, message):
    with pytest.raises(DdpkitError, match=re.escape(message)):
        check(config, world)


@pytest.mark.parametrize(
    "config, world",
    [
        (StrategyConfig(), 1),  # DDP runs on one process as it is
        (
            StrategyConfig(name="auto", compile=True, fused_optimizer="on"),
            1,
        ),  # auto may pick DDP: checked again once it has
        (FSDP, 2),
        (FSDP, None),  # the number of processes is not known yet (--nproc auto): the launcher checks again
        (StrategyConfig(name="fsdp", grad_sync="backend", fused_optimizer="auto", precision="bf16"), 8),
        # --compile under every strategy, with activation checkpointing too (each block's forward: compiling.py)
        (StrategyConfig(name="fsdp", compile=True, activation_checkpointing=True), 2),
        (StrategyConfig(name="hsdp", compile=True, replicate=2), 4),
        (StrategyConfig(name="ddp", compile=True, activation_checkpointing=True), 2),
    ],
)
def test_check_accepts(config, world):
    check(config, world)


@pytest.mark.parametrize(
    "config, world, message",
    [
        (StrategyConfig(name="deepspeed"), 2, "rt.wrap(strategy=...) must be 'ddp' or 'fsdp', got 'deepspeed'"),
        (StrategyConfig(name="auto"), 2, "rt.wrap(strategy=...) must be 'ddp' or 'fsdp', got 'auto'"),
        (
            StrategyConfig(name="fsdp", grad_sync="shm", ddp_options={"find_unused_parameters": True}),
            2,
            "rt.wrap(strategy='fsdp'): find_unused_parameters, grad_sync are DDP options; "
            "drop them or use strategy='ddp'",
        ),
        (
            StrategyConfig(name="fsdp", precision="fp16"),
            2,
            "precision='fp16' needs a gradient scaler, which ddpkit offers under DDP only; use 'bf16' with FSDP",
        ),
        (FSDP, 1, "needs at least 2 (start the script with 2 or more processes); with one process use strategy='ddp'"),
    ],
)
def test_the_own_loop_spelling_names_rt_wraps_keywords(config, world, message):
    with pytest.raises(DdpkitError, match=re.escape(message)):
        check(config, world, own_loop=True)


def test_a_device_mesh_must_hold_every_process():
    check(FSDP, 4, mesh_shape=(2, 2))
    check(FSDP, 4, mesh_shape=(1, 4))  # the default: every rank one shard, no replica
    with pytest.raises(
        DdpkitError, match=re.escape("a device mesh of 2 x 2 (replicate x shard) holds 4 processes, but the job has 6")
    ):
        check(FSDP, 6, mesh_shape=(2, 2))
    with pytest.raises(DdpkitError, match=re.escape("two positive sizes (replicate, shard), got (0, 4)")):
        check(FSDP, 4, mesh_shape=(0, 4))


def test_config_launcher_and_session_refuse_alike():
    """The same rule, asked by its three callers, says the same thing."""
    with pytest.raises(DdpkitError, match=re.escape(FSDP_NEEDS_TWO)):
        RunConfig(strategy="fsdp", nproc=1)
    with pytest.raises(DdpkitError, match=re.escape(FSDP_NEEDS_TWO)):
        _check_strategy(RunConfig(strategy="fsdp"), "cpu", 1)  # --nproc auto turned out to be one process
    with pytest.raises(DdpkitError, match=re.escape("--bucket-mb: DDP options")):
        RunConfig(strategy="fsdp", nproc=2, bucket_mb=4.0)
    with (
        Session(DistEnv(), device="cpu", threads=1) as rt,
        pytest.raises(DdpkitError, match="needs at least 2 \\(start"),
    ):
        rt.wrap(nn.Linear(2, 2), strategy="fsdp")


def test_an_fsdp_strategy_refuses_a_mesh_that_does_not_fit_the_job():
    from ddpkit.runtime import Runtime
    from ddpkit.strategies.fsdp import FsdpStrategy

    with Runtime(DistEnv(), device="cpu", threads=1) as rt, pytest.raises(DdpkitError, match="needs at least 2"):
        FsdpStrategy(rt, FSDP, mesh_shape=(1, 1))


HSDP = StrategyConfig(name="hsdp")


@pytest.mark.parametrize(
    "config, world, message",
    [
        (StrategyConfig(name="hsdp", replicate=3), 4, "--replicate 3 does not divide the 4 processes into equal"),
        (StrategyConfig(name="hsdp", replicate=0), None, "--replicate must be a positive number of replicas, got 0"),
        (StrategyConfig(name="fsdp", replicate=3), 4, "--replicate 3 does not divide the 4 processes into equal"),
        (StrategyConfig(name="ddp", replicate=2), 4, "use --strategy fsdp --replicate 2, or drop --replicate"),
        (HSDP, 1, "--strategy hsdp shards the model across processes and needs at least 2"),
        (StrategyConfig(name="hsdp", precision="fp16"), 4, "use --precision bf16 with --strategy hsdp"),
        (StrategyConfig(name="hsdp", bucket_mb=4.0), 4, "--bucket-mb: DDP options, not available with --strategy hsdp"),
        (StrategyConfig(name="hsdp", async_save=True), 4, "drop --async-save with --strategy hsdp"),
    ],
)
def test_hsdp_keeps_fsdps_rules_and_its_replicas_divide_the_job(config, world, message):
    with pytest.raises(DdpkitError, match=re.escape(message)):
        check(config, world)


def test_hsdp_replicates_across_nodes_and_shards_within_one_by_default():
    assert hsdp_mesh(HSDP, 8, nnodes=2) == (2, 4)  # global ranks 0-3 on node 0: one shard group per node
    assert hsdp_mesh(HSDP, 4, nnodes=1) == (1, 4)  # one node: FSDP over all 4
    assert hsdp_mesh(StrategyConfig(name="hsdp", replicate=2), 4, nnodes=1) == (2, 2)
    assert hsdp_mesh(StrategyConfig(name="hsdp", replicate=4), 8, nnodes=2) == (4, 2)
    with pytest.raises(DdpkitError, match=re.escape("this node runs 4 of the 6 processes: start the same number")):
        hsdp_mesh(HSDP, 6, nnodes=6 // 4, local_world_size=4)  # nodes of 4 and 2 processes: no even replicas
    assert hsdp_mesh(StrategyConfig(name="hsdp", replicate=2), 6, nnodes=1, local_world_size=4) == (2, 3)
    assert "which is --strategy fsdp" in hsdp_note((1, 4)) and "2 replicas x 2 shards" in hsdp_note((2, 2))
    check(HSDP, 4)
    check(StrategyConfig(name="hsdp", replicate=2, precision="bf16"), 4, mesh_shape=(2, 2))
    assert RunConfig(strategy="hsdp", replicate=2, nproc=4).strategy_config().replicate == 2
    with pytest.raises(DdpkitError, match=re.escape("--replicate 3 does not divide the 4 processes")):
        RunConfig(strategy="hsdp", replicate=3, nproc=4)
    with pytest.raises(DdpkitError, match=re.escape("--replicate 3 does not divide the 8 processes")):
        _check_strategy(
            RunConfig(strategy="hsdp", replicate=3, nnodes="2", master_addr="10.0.0.1", node_rank=0), "cpu", 8
        )


def test_hsdp_is_fsdp_with_replicas_and_the_hsdp_spelling_only_changes_the_default():
    assert fsdp_mesh(StrategyConfig(name="fsdp"), 4, nnodes=2) == (1, 4)  # no replicas unless asked
    assert fsdp_mesh(StrategyConfig(name="fsdp", replicate=2), 4, nnodes=1) == (2, 2)
    assert fsdp_mesh(StrategyConfig(name="fsdp", replicate=2), 8, nnodes=2) == hsdp_mesh(HSDP, 8, nnodes=2)
    check(StrategyConfig(name="fsdp", replicate=2), 4, mesh_shape=(2, 2))
    assert RunConfig(strategy="fsdp", replicate=2, nproc=4).strategy_config().replicate == 2
    fsdp, hsdp = strategy_spec("fsdp"), strategy_spec("hsdp")
    assert (fsdp.build, fsdp.memory, fsdp.rules) == (hsdp.build, hsdp.memory, hsdp.rules)  # one FSDP
    assert fsdp_note((1, 4)) is None and "2 replicas x 2 shards (HSDP" in fsdp_note((2, 2))
    assert (fsdp.column((1, 4)), fsdp.column((2, 2)), hsdp.column((1, 4))) == ("FSDP x4", "FSDP 2x2", "HSDP 1x4")
