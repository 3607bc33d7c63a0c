"""`ddpkit plan --tp/--pp` predicts what each rank sends per step on each mesh dim: at 4 processes on
three meshes (FSDP x TP 2x2, HSDP x TP 2x1x2, DDP x PP 2x2) the plan's bytes are within 10% of what the collectives
recorder (runtime/traffic.py) counts on every rank in steps 2 and 3 of a real `ddpkit train` of
the same task (examples/tp_gpt.py, tiny), dim by dim, by the same ring rules; nothing else sends
more than the step's small agreement over the whole world."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, run_ddpkit
from ddpkit.parallel.dims import ParallelDims
from ddpkit.runtime.traffic import group_names

TASK = str(REPO / "tests" / "distributed" / "scripts" / "traffic_task.py") + ":build"
COMMON = ["--nproc", "4", "--batch-size", "4"]
MESHES = {
    # dp_shard 2 x tp 2: tp all-reduces of activations, FSDP's gathers and reduce-scatter of tp-local shards
    "fsdp-x-tp": ["--tp", "2", "--strategy", "fsdp"],
    # dp_replicate 2 x dp_shard 1 x tp 2: HSDP's all-reduce of the (whole) gradient shards between replicas
    "hsdp-x-tp": ["--tp", "2", "--strategy", "hsdp", "--replicate", "2"],
    # pp 2 x dp_replicate 2: 2 micro-batches of 2 between the stages, the stages' gradients all-reduced
    "ddp-x-pp": ["--pp", "2", "--strategy", "ddp"],
}
EXPECTED = {"fsdp-x-tp": {"tp", "dp_shard"}, "hsdp-x-tp": {"tp", "dp_replicate"}, "ddp-x-pp": {"pp", "dp_replicate"}}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESHES))
def test_the_plans_bytes_per_dim_are_what_each_rank_sends(tmp_path, mesh):
    flags = [*COMMON, *MESHES[mesh]]
    out = tmp_path / "traffic"
    run_ddpkit(
        "train", TASK, *flags, "--max-steps", "3", "--save-every", "0", "--threads", "1", "--quiet",
        "--run-dir", str(tmp_path / "run"), "--task-arg", f"out={out}", timeout=300,
    )  # fmt: skip
    plan = json.loads(run_ddpkit("plan", TASK, *flags, "--json").stdout)["mesh"]
    for rank in range(4):
        dims = ParallelDims(**plan["mesh"], rank=rank)
        predicted = plan["per_stage"][dims.pp_rank]["sent_per_step"]
        assert set(predicted) == EXPECTED[mesh] and all(b > 1000 for b in predicted.values()), predicted
        names = group_names(dims)
        steps = json.loads((out / f"rank-{rank}.json").read_text())
        assert len(steps) == 3, steps
        for step in steps[1:]:  # the first step's interval holds the setup too
            recorded: dict[str, float] = {}
            for ranks, sent in step.items():
                name = names[tuple(sorted(int(r) for r in ranks.split(",")))]
                recorded[name] = recorded.get(name, 0.0) + sent
            for dim, bytes_ in predicted.items():
                assert abs(recorded.get(dim, 0.0) - bytes_) <= 0.1 * bytes_, (rank, dim, recorded, predicted)
            assert set(recorded) <= {*predicted, "world"}, recorded
            assert recorded.get("world", 0.0) < 0.01 * sum(predicted.values()), recorded  # the step's agreement
