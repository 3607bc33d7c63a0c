"""The memory plan, FSDP's default block policy, lockstep evaluation, precision checks and
sharded-checkpoint discovery: the parts of --strategy fsdp that need no process group."""

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddpkit import DdpkitError
from ddpkit.checkpoint.sharded import list_sharded, validate_sharded
from ddpkit.config import RunConfig, parse_memory
from ddpkit.data import eval_batches
from ddpkit.planning.memory import make_plan
from ddpkit.planning.process import optimizer_state_per_param
from ddpkit.strategies.fsdp import default_blocks
from ddpkit.strategies.precision import check_precision


@pytest.mark.parametrize(
    "text, size",
    [
        ("80GB", 80 * 10**9),
        ("24GiB", 24 * 2**30),
        ("512mb", 512 * 10**6),
        ("1.5 GiB", int(1.5 * 2**30)),
        ("4096", 4096),
        (None, None),
    ],
)
def test_device_memory_sizes(text, size):
    assert parse_memory(text) == size


@pytest.mark.parametrize("text", ["lots", "0GB", "-1GB", "12XB", ""])
def test_bad_device_memory_says_what_to_write(text):
    with pytest.raises(DdpkitError, match="such as 80GiB"):
        parse_memory(text)


def test_run_config_takes_strategy_precision_and_a_memory_size():
    cfg = RunConfig(strategy="fsdp", nproc=2, precision="bf16", device_memory="2GiB")
    assert cfg.device_memory == 2 * 2**30 and RunConfig.from_dict(cfg.as_dict()) == cfg
    with pytest.raises(DdpkitError, match="needs at least 2"):
        RunConfig(strategy="fsdp", nproc=1)
    with pytest.raises(DdpkitError, match="--strategy must be one of ddp, fsdp, hsdp, auto"):
        RunConfig(strategy="zero3")
    with pytest.raises(DdpkitError, match="--precision must be one of fp32, bf16, fp16"):
        RunConfig(precision="int8")


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda: torch.optim.Adam([nn.Parameter(torch.zeros(1))]), 8.0),
        (lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), 4.0),
        (lambda params: torch.optim.SGD(params, lr=0.1), 0.0),
    ],
)
def test_optimizer_state_is_measured_by_a_probe_step(make, expected):
    spec = make() if make.__code__.co_argcount == 0 else make
    assert optimizer_state_per_param(spec)[1:] == (expected, True)


def test_plan_shards_each_parameter_on_dim0_with_fsdps_padding():
    model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 3))  # 3 rows over 2 ranks: 2 + 1 (padded to 2)
    plan = make_plan(model, lambda p: torch.optim.Adam(p), 2, "fp32", 10**9, "test", default_blocks)
    full = sum(p.numel() for p in model.parameters()) * 4
    shard = (32 * 10 + 32 + 2 * 64 + 2) * 4
    assert (plan.ddp.params, plan.ddp.grads, plan.ddp.optimizer) == (full, full, 2 * full)
    assert (plan.fsdp.params, plan.fsdp.grads, plan.fsdp.optimizer) == (shard, shard, 2 * shard)
    assert plan.units == 3 and plan.choose() == "ddp"


def test_auto_picks_ddp_when_it_fits_else_fsdp():
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    need = make_plan(model, lambda p: torch.optim.Adam(p), 4, "fp32", 1, "x").ddp.total
    assert make_plan(model, lambda p: torch.optim.Adam(p), 4, "fp32", 2 * need, "x").choose() == "ddp"
    small = make_plan(model, lambda p: torch.optim.Adam(p), 4, "fp32", need, "x")  # only 80% of it is planned for
    assert small.choose() == "fsdp" and small.fits("fsdp") and "fsdp: DDP needs" in small.reason()
    alone = make_plan(model, lambda p: torch.optim.Adam(p), 1, "fp32", need, "x")
    assert alone.choose() == "ddp" and "expect out-of-memory" in alone.reason()


def test_hsdp_shards_over_one_node_and_only_gradient_shards_cross_nodes():
    model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 3))
    adam = lambda p: torch.optim.Adam(p)  # noqa: E731
    plan = make_plan(model, adam, 4, "fp32", 10**9, "test", default_blocks, strategy="hsdp", replicate=2, nnodes=2)
    over_2 = make_plan(model, adam, 2, "fp32", 10**9, "test", default_blocks).fsdp
    assert plan.hsdp == over_2 and plan.hsdp.state > plan.fsdp.state  # shards over S=2, not over all 4
    n = sum(p.numel() for p in model.parameters())
    shard_grads = (32 * 10 + 32 + 2 * 64 + 2) * 4  # one rank's gradient shard, fp32, as FSDP2 pads it
    assert plan.cross_node == {
        "ddp": int(2 * 3 / 4 * n * 4),  # ring all-reduce of every gradient over 4 ranks
        "fsdp": int(3 / 4 * (2 * n * 4 + n * 4)),  # all-gathers in forward and backward, one reduce-scatter
        "hsdp": int(2 * 1 / 2 * shard_grads),  # the 2 replicas' all-reduce of the gradient shards
    }
    out = plan.format("net", "hsdp")
    assert "HSDP 2x2" in out and "across nodes" in out and "FSDP yes, HSDP yes" in out
    assert "--strategy hsdp  HSDP needs" in out
    # shard groups that span nodes (8 ranks on 4 nodes of 2, shards of 4): HSDP's gathers cross too
    wide = make_plan(model, adam, 8, "fp32", 10**9, "test", default_blocks, strategy="hsdp", replicate=2, nnodes=4)
    assert wide.cross_node["hsdp"] > int(2 * 1 / 2 * (16 * 10 + 16 + 16 * 64 + 1) * 4)
    one_node = make_plan(model, adam, 4, "fp32", 10**9, "test", default_blocks, strategy="hsdp", replicate=2)
    assert one_node.cross_node == {} and "across nodes" not in one_node.format("net", "hsdp")


def test_the_plan_command_shows_hsdp_per_node(capsys):
    from ddpkit.cli import main

    deep = str(Path(__file__).resolve().parents[3] / "examples" / "deep_mlp.py") + ":build"
    assert main(["plan", deep, "--strategy", "hsdp", "--nproc", "4", "--nnodes", "2", "--device-memory", "3MB"]) == 0
    out = capsys.readouterr().out
    assert "8 processes, fp32" in out and "FSDP x8       HSDP 2x4" in out
    assert "between the 2 nodes; HSDP: only its all-reduce of gradient shards" in out


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList(
            [nn.Sequential(nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 8)])) for _ in range(3)]
        )
        self.head = nn.Linear(8, 2)


def test_default_blocks_are_the_outermost_module_list_elements_or_sequential_children():
    net = _Net()
    assert default_blocks(net) == list(net.layers)  # not the nested ModuleList inside each layer
    seq = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    assert default_blocks(seq) == [seq[0], seq[2]]
    assert default_blocks(nn.Linear(2, 2)) == []  # the root alone is one unit


@pytest.mark.parametrize("n, world, batch", [(37, 2, 18), (36, 5, 4), (3, 4, 8), (142, 3, 10)])
def test_lockstep_eval_gives_every_rank_the_same_number_of_batches_and_each_sample_once(n, world, batch):
    ds = TensorDataset(torch.arange(n).float(), torch.arange(n))
    per_rank = [list(eval_batches(ds, batch, r, world, lockstep=True)) for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1
    seen = sorted(i for batches in per_rank for _, y in batches for i in y.tolist())
    assert seen == list(range(n))


def test_bf16_is_refused_on_a_cpu_without_it(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    with pytest.raises(DdpkitError, match="no native bfloat16"):
        check_precision("bf16", "cpu")
    assert check_precision("fp32", "cpu") is None


def test_bf16_is_used_on_a_cpu_with_it(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert check_precision("bf16", "cpu") is torch.bfloat16


def test_only_complete_sharded_checkpoints_are_listed_and_accepted(tmp_path):
    ckpts = tmp_path / "checkpoints"
    for name in ("epoch-000002", ".epoch-000004.partial", "epoch-000003"):
        (ckpts / name).mkdir(parents=True)
    (ckpts / "epoch-000001.pt").write_bytes(b"a file: DDP's kind")
    assert [e for e, _ in list_sharded(tmp_path)] == [(3, 0), (2, 0)]  # (epoch, step)
    with pytest.raises(DdpkitError, match="not a complete ddpkit sharded checkpoint"):
        validate_sharded(ckpts / "epoch-000003", nn.Linear(2, 2), None)
