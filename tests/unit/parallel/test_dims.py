"""The mesh's owner (parallel/dims.py): each rank's place on the named dims, what the sampler,
the loss and clip_grad_norm ask of it, and the refusals of degrees the processes cannot form."""

import subprocess
import sys

import pytest

from ddpkit.config import RunConfig
from ddpkit.errors import DdpkitError
from ddpkit.parallel.dims import ParallelDims, check_degrees
from ddpkit.parallel.spec import StrategyConfig, check, dp_layout, mesh_dims


def placed(dims: ParallelDims, rank: int) -> ParallelDims:
    return ParallelDims(dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, rank)


def test_tp_is_innermost_so_a_tp_group_is_consecutive_ranks_with_one_dp_index():
    dims = ParallelDims.of(8, tp=2, shards=True, replicate=2)  # 2 replicas x 2 shards x 2 tp
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.dp) == (2, 2, 2, 1, 4)
    seen = [(placed(dims, r).dp_rank, placed(dims, r).tp_rank) for r in range(8)]
    assert seen == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    assert dims.names == ("dp_replicate", "dp_shard", "tp") and dims.shape == (2, 2, 2)
    assert dims.dp_names == ("dp_replicate", "dp_shard")
    assert dims.grad_norm_names == dims.names


def test_pipeline_stages_are_outermost_and_see_the_same_shares():
    dims = ParallelDims.of(8, tp=2, pp=2, shards=False)  # DDP: the dp rest is replicas
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp) == (2, 2, 1, 2)
    first = [r for r in range(8) if placed(dims, r).is_first_stage]
    last = [r for r in range(8) if placed(dims, r).is_last_stage]
    assert first == [0, 1, 2, 3] and last == [4, 5, 6, 7]
    assert [placed(dims, r).dp_rank for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    # one rank per data-parallel share counts its loss and eval samples: tp rank 0 of the last stage
    assert [r for r in range(8) if placed(dims, r).counts_samples] == [4, 6]
    assert dims.describe() == "pp 2 x dp_replicate 2 x tp 2"


def test_one_process_and_pure_data_parallel():
    one = ParallelDims()
    assert (one.world_size, one.dp, one.dp_rank, one.names, one.counts_samples) == (1, 1, 0, ("dp_shard",), True)
    assert one.describe() == "one process"
    ddp = ParallelDims.of(4, shards=False, rank=3)
    assert (ddp.dp, ddp.dp_rank, ddp.names) == (4, 3, ("dp_replicate",))
    fsdp = ParallelDims.of(4, shards=True, rank=3)
    assert (fsdp.dp_shard, fsdp.dp_rank, fsdp.names, fsdp.dp_names) == (4, 3, ("dp_shard",), ("dp_shard",))


def test_mesh_dims_follows_each_strategy_layout():
    hsdp = mesh_dims(StrategyConfig(name="hsdp", tp=2), 8, nnodes=2, local_world_size=4)
    assert (hsdp.dp_replicate, hsdp.dp_shard, hsdp.tp) == (2, 2, 2)  # one replica per node, tp inside it
    # what the strategy lays its FSDP mesh out by (strategy_for): the same, a node's 4 processes being 2 dp ranks
    assert dp_layout(StrategyConfig(name="hsdp", tp=2), 8, 2, 4) == (2, 2)
    fsdp = mesh_dims(StrategyConfig(name="fsdp", tp=2, replicate=2), 8, rank=5)
    assert (fsdp.dp_replicate, fsdp.dp_shard, fsdp.dp_rank, fsdp.tp_rank) == (2, 2, 2, 1)
    ddp = mesh_dims(StrategyConfig(name="ddp", tp=2), 4, rank=2)
    assert (ddp.dp_replicate, ddp.dp_shard, ddp.dp_rank) == (2, 1, 1)


def test_the_batch_plan_is_cut_among_the_data_parallel_ranks():
    plan = RunConfig(task="wine", strategy="fsdp", tp=2, batch_size=8).batch_plan(4)
    assert (plan.world_size, plan.global_batch) == (2, 16)  # 2 dp ranks x 8, as 2 processes of DDP
    fixed = RunConfig(task="wine", strategy="fsdp", tp=4, global_batch_size=10, batch_size=4).batch_plan(8)
    assert (fixed.world_size, fixed.share(0), fixed.share(1), fixed.accumulate) == (2, 5, 5, 2)
    piped = RunConfig(task="wine", strategy="ddp", pp=2, save_every=0, global_batch_size=10, batch_size=4)
    assert piped.batch_plan(4).world_size == 2  # 2 stages: 2 dp ranks of 4 processes


@pytest.mark.parametrize(
    "world, local, tp, pp, words",
    [
        (4, 4, 3, 1, "--tp 3 does not divide the 4 processes of a node"),
        (8, 4, 2, 3, "--tp 2 x --pp 3 = 6 does not divide the 8 processes"),
        (4, 4, 0, 1, "--tp must be a positive number"),
        (4, 4, 1, -1, "--pp must be a positive number"),
    ],
)
def test_degrees_the_processes_cannot_form_are_one_line(world, local, tp, pp, words):
    with pytest.raises(DdpkitError, match=words.replace("+", r"\+")) as e:
        check_degrees(world, tp, pp, local)
    assert "\n" not in str(e.value)


def test_replicas_divide_the_data_parallel_ranks_not_the_world():
    check(StrategyConfig(name="fsdp", tp=2, replicate=2), 8)  # 4 dp ranks: 2 x 2
    with pytest.raises(DdpkitError, match="--replicate 4 does not divide the 2 data-parallel processes"):
        check(StrategyConfig(name="fsdp", tp=2, replicate=4), 4)


def test_pipeline_settings_are_checked():
    with pytest.raises(DdpkitError, match="--pp-schedule must be one of gpipe, 1f1b, interleaved-1f1b"):
        RunConfig(task="wine", pp_schedule="zb")
    with pytest.raises(DdpkitError, match="--pp-microbatches must be a positive number"):
        RunConfig(task="wine", pp_microbatches=0)
    assert RunConfig(task="wine").strategy_config().pp_schedule == "1f1b"


def test_tp_3_at_4_processes_is_one_line_and_exit_2_before_any_worker(tmp_path):
    """The real command line: refused by the config's check, no run directory made, no worker started."""
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "ddpkit", "train", "wine", "--nproc", "4", "--tp", "3", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "ddpkit: error: --tp 3 does not divide the 4 processes of a node: a tensor-parallel group stays within one "
        "node; choose a --tp that divides --nproc 4"
    ]
    assert not run_dir.exists()


def test_a_pipeline_saves_and_resumes_but_keeps_no_memory_snapshots():
    RunConfig(task="wine", strategy="ddp", pp=2, save_every=1, save_every_steps=2, resume=True, run_dir="r")
    RunConfig(task="wine", strategy="ddp", pp=2, snapshot_every_steps=0)  # off: nothing to refuse
    with pytest.raises(DdpkitError, match="--snapshot-every-steps with --pp 2: a pipeline's stages keep no") as e:
        RunConfig(task="wine", strategy="ddp", pp=2, snapshot_every_steps=2)
    assert "\n" not in str(e.value)
