"""The mesh plan's arithmetic (planning/mesh.py) on a 128-node mesh (pp 4 x dp_shard 32 x tp 8), the
numbers worked by hand; the ring rules and the schedules' micro-batches in flight; the sizes
measured on a model as one tp rank of each stage holds it (training/mesh_probe.py); `ddpkit plan`
for 128 nodes end to end (what training does not build yet said in one line)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from torch import nn

from ddpkit.parallel.dims import ParallelDims
from ddpkit.parallel.footprints import ModelSizes
from ddpkit.planning.mesh import (
    Linear,
    StageSizes,
    in_flight,
    plan_mesh,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    traffic,
)

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
MIB = 2**20


def test_ring_rules():
    assert ring_all_reduce(800, 8) == 1400  # 2 (n-1)/n of the buffer
    assert ring_all_gather(100, 32) == 3100  # (n-1) x this rank's part
    assert ring_reduce_scatter(3200, 32) == 3100  # (n-1)/n of the input
    assert ring_all_reduce(800, 1) == ring_all_gather(5, 1) == ring_reduce_scatter(5, 1) == 0


@pytest.mark.parametrize(
    "schedule, rank, pp, m, held",
    [
        ("1f1b", 0, 4, 8, 4),  # the first stage holds pp micro-batches before its first backward
        ("1f1b", 3, 4, 8, 1),  # the last runs each backward right after its forward
        ("1f1b", 1, 4, 2, 2),  # fewer micro-batches than stages: ddpkit runs GPipe
        ("gpipe", 3, 4, 8, 8),  # every forward before any backward
        ("interleaved-1f1b", 0, 4, 8, 5.5),  # Megatron's warm-up 2(pp-1) + (v-1) pp = 10, + 1; chunks of half
        ("interleaved-1f1b", 3, 4, 8, 2.5),
        ("1f1b", 0, 1, 8, 1),  # no pipeline: one micro-batch at a time
    ],
)
def test_micro_batches_in_flight(schedule, rank, pp, m, held):
    assert in_flight(schedule, rank, pp, m) == held


def _stage(blocks: int, first: bool, last: bool) -> StageSizes:
    """A stage of `blocks` transformer blocks of width 4096 at tp 8 (each block's tp-local
    parameters: 12 x 4096^2 / 8 weights, biases left out), the embedding on the first stage."""
    block = (((512, 4096), 4),) * 3 + (((4096, 512), 4), ((2048, 4096), 4), ((4096, 2048), 4))  # q k v o up down
    root = (((50304, 4096), 4),) if first else ()
    shapes = tuple(s for _ in range(blocks) for s in block) + root
    per_block = sum(a * b for (a, b), _ in block)
    sizes = ModelSizes(shapes, 8.0, "bf16", root=50304 * 4096 if first else 0, largest_block=per_block, blocks=blocks)
    hidden = 2048 * 4096 * 2  # one sample's hidden state, bf16
    return StageSizes(
        sizes,
        root,
        tp_forward=Linear(0, blocks * 2 * hidden),  # o and down: outputs all-reduced
        tp_backward=Linear(0, blocks * 4 * hidden),  # q, k, v, up: input gradients all-reduced
        send_forward=Linear(0, 0 if last else hidden),
        send_backward=Linear(0, 0 if first else hidden),
        activations=Linear(1000, 100 * MIB),
    )


def test_a_128_node_mesh_worked_by_hand():
    dims = ParallelDims(dp_shard=32, tp=8, pp=4)
    assert dims.world_size == 1024
    stages = [_stage(8, s == 0, s == 3) for s in range(4)]
    plan = plan_mesh(stages, dims, strategy="fsdp", micro_batch=2, microbatches=4, fixed=100, budget=80 * 2**30)
    hidden = 2048 * 4096 * 2 * 2  # a micro-batch of 2
    first, middle = plan.ranks[0], plan.ranks[1]
    # tp: 6 all-reduces of the hidden state per block per micro-batch, 2 x 7/8 of each, 8 blocks, 4 micro-batches
    assert middle.traffic["tp"] == int(4 * 8 * 6 * hidden * 2 * 7 / 8)
    # pp: the first stage sends 4 hidden states on; a middle stage those and 4 gradients back
    assert first.traffic["pp"] == 4 * hidden and middle.traffic["pp"] == 8 * hidden
    # dp_shard: per micro-batch each block gathered twice in bf16 (31 x its shard), per step the
    # gradients reduce-scattered in fp32 (31/32 of 32 shards)
    shard = sum(-(-a // 32) * b for (a, b), _ in stages[1].sizes.shapes)
    assert middle.traffic["dp_shard"] == 4 * 31 * 2 * shard * 2 + 31 * shard * 4
    assert "dp_replicate" not in middle.traffic
    # the embedding (the first stage's root unit) is gathered once per micro-batch, not twice
    root = -(-50304 // 32) * 4096
    assert first.traffic["dp_shard"] - middle.traffic["dp_shard"] == 4 * 31 * root * 2 + 31 * root * 4
    # memory: the shards in fp32, AdamW's 8 bytes per element; 1F1B holds 4, 3, 2, 1 micro-batches
    assert middle.state.params == shard * 4 and middle.state.optimizer == shard * 8
    assert [r.in_flight for r in plan.ranks] == [4, 3, 2, 1]
    assert first.activations_held == 4 * (1000 + 2 * 100 * MIB)
    assert plan.peak == first.total == 100 + first.state.total + first.activations_held
    assert plan.global_batch == 2 * 4 * 32 and plan.bubble == pytest.approx(3 / 7)
    assert plan.fits(0.9)


def test_ddp_and_hsdp_send_their_gradients_between_replicas():
    stage = _stage(2, True, True)
    grads = stage.sizes.nbytes()  # every tp-local gradient, fp32 (reduce dtype under bf16)
    ddp = traffic([stage], ParallelDims(dp_replicate=4, tp=8), False, 2, 1, bf16=True)
    assert ddp["dp_replicate"] == int(2 * 3 / 4 * grads) and "dp_shard" not in ddp
    hsdp = traffic([stage], ParallelDims(dp_replicate=4, dp_shard=2, tp=8), True, 2, 1, bf16=True)
    assert hsdp["dp_replicate"] == int(2 * 3 / 4 * stage.sizes.nbytes(2))  # the gradient shards only


def test_accumulation_gathers_every_micro_batch_and_reduces_once():
    stage, dims = _stage(2, False, False), ParallelDims(dp_shard=4, tp=8)
    one = traffic([stage], dims, True, 2, 1, bf16=False)["dp_shard"]
    four = traffic([stage], dims, True, 2, 4, bf16=False)["dp_shard"]
    gather = 3 * 2 * stage.sizes.nbytes(4)
    assert four - one == 3 * gather


def test_the_probe_sees_one_tp_rank_of_each_stage():
    sys.path.insert(0, str(EXAMPLES))
    import tp_gpt

    from ddpkit.strategies.blocks import default_blocks
    from ddpkit.training.mesh_probe import measure_stages

    task = tp_gpt.build(None, vocab=64, block_size=16, n_layer=4, n_head=4, n_embd=32, samples=4)
    whole = measure_stages(task, tp=1, n_stages=1, blocks=default_blocks, per_param=8.0)[0]
    split = measure_stages(task, tp=2, n_stages=2, blocks=default_blocks, per_param=8.0)
    hidden = 16 * 32 * 4  # one sample's hidden state, fp32
    for s in split:  # 2 blocks a stage: o and down all-reduce their outputs, q, k, v and up their inputs' gradients
        assert s.tp_forward == Linear(0, 2 * 2 * hidden) and s.tp_backward == Linear(0, 2 * 4 * hidden)
    assert split[0].send_forward == Linear(0, hidden) and split[0].send_backward == Linear(0, 0)
    assert split[1].send_backward == Linear(0, hidden) and split[1].send_forward == Linear(0, 0)
    assert whole.tp_forward == whole.tp_backward == Linear(0, 0)
    # a block: 12 d^2 weights, biases q k v o d each, up 4d, down d, two norms 2d each; at tp 2 the weights
    # halved, q's k's v's and up's biases halved, o's and down's biases and the norms whole
    d = 32
    block_whole, block_half = 12 * d * d + 9 * d + 4 * d, 6 * d * d + (3 * d // 2 + d + 2 * d + d) + 4 * d
    embeddings, head = 64 * d + 16 * d, d * 64 + 2 * d  # wte, wpe; head (no bias) and ln_f
    assert whole.sizes.numel() == 4 * block_whole + embeddings + head
    assert split[0].sizes.numel() == 2 * block_half + embeddings
    assert split[1].sizes.numel() == 2 * block_half + head
    assert split[0].sizes.blocks == 2 and split[0].sizes.root == embeddings


def test_plan_for_128_nodes_end_to_end(capsys):
    from ddpkit.cli import main

    args = ["plan", str(EXAMPLES / "tp_gpt.py") + ":build", "--nnodes", "128", "--nproc", "8", "--tp", "8", "--pp", "4"]
    args += ["--strategy", "fsdp", "--batch-size", "8", "--device-memory", "80GB", "--start-method", "spawn", "--json"]
    for k, v in dict(n_layer=8, n_embd=256, n_head=8, block_size=64, vocab=512, init="meta", samples=4).items():
        args += ["--task-arg", f"{k}={v}"]
    assert main(args) == 0
    mesh = json.loads(capsys.readouterr().out)["mesh"]
    assert mesh["mesh"] == {"pp": 4, "dp_replicate": 1, "dp_shard": 32, "tp": 8} and mesh["world_size"] == 1024
    assert mesh["micro_batch"] == 2 and mesh["microbatches"] == 4 and mesh["global_batch"] == 256
    stages = mesh["per_stage"]
    assert [s["microbatches_in_flight"] for s in stages] == [4, 3, 2, 1]
    hidden = 2 * 64 * 256 * 4  # a micro-batch's hidden state, fp32
    assert [s["sent_per_step"]["pp"] for s in stages] == [4 * hidden, 8 * hidden, 8 * hidden, 4 * hidden]
    assert stages[1]["sent_per_step"]["tp"] == int(4 * 2 * 6 * hidden * 2 * 7 / 8)  # 2 blocks a stage
    assert "fsdp with --pp 4 is not built" in mesh["refused"]


def test_a_model_tp_cannot_split_is_one_line(capsys):
    from ddpkit.cli import main

    args = ["plan", str(EXAMPLES / "gpt.py") + ":build", "--nproc", "4", "--tp", "2", "--strategy", "fsdp"]
    assert main([*args, "--batch-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "blocks.0.attn.qkv: q/k/v fused into one Linear cannot be column-split" in err


def test_localize_resizes_what_a_tp_rank_holds():
    from ddpkit.training.mesh_probe import localize

    model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64))
    localize(model, {"0": "colwise", "1": "rowwise"}, 8)
    assert model[0].weight.shape == (32, 64) and model[0].bias.shape == (32,)
    assert model[1].weight.shape == (64, 32) and model[1].bias.shape == (64,)  # a rowwise bias stays whole


def test_a_mesh_the_processes_cannot_form_is_one_line_before_any_plan(capsys):
    from ddpkit.cli import main

    task = str(EXAMPLES / "tp_gpt.py") + ":build"
    assert main(["plan", task, "--nproc", "4", "--tp", "3", "--batch-size", "2"]) == 2
    captured = capsys.readouterr()
    assert (
        captured.out == ""
        and captured.err.count("\n") == 1
        and "--tp 3 does not divide the 4 processes" in captured.err
    )
