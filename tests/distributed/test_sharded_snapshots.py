"""FSDP keeps memory snapshots too: every rank writes its own shards into its node's memory, and
a restart resumes from them when every shard of one step survived (here a worker crashed and
no node was lost). The run must end at the uninterrupted run's model (float64, SGD with momentum:
a wrong shard, a lost optimizer state or a sample trained twice would move it by far more than
1e-5). Losing a node: tests/cluster/test_node_loss.py (HSDP from the surviving replica group)."""

import json

import pytest

from conftest import REPO, assert_state_close, load_model, run_ddpkit

TASK = str(REPO / "tests" / "cluster" / "scripts" / "wine_float64_sgd.py") + ":build"
# 142 samples, 16 a step: 9 steps an epoch; a disk checkpoint every 20 steps, a snapshot every 2
TRAIN = (TASK, "--epochs", "8", "--batch-size", "8", "--seed", "5", "--threads", "1", "--nproc", "2")
TRAIN += ("--save-every", "0", "--eval-every", "1000", "--quiet")


@pytest.mark.slow
def test_a_crashed_fsdp_worker_resumes_from_every_ranks_shards_in_memory(tmp_path, reference_run):
    reference = load_model(reference_run(*TRAIN))
    run_dir = tmp_path / "run"
    proc = run_ddpkit(
        "train",
        *TRAIN,
        "--strategy",
        "fsdp",
        "--run-dir",
        str(run_dir),
        "--max-restarts",
        "1",
        "--save-every-steps",
        "20",
        "--snapshot-every-steps",
        "2",
        env={"WINE_EXIT_STEP": "31", "WINE_EXIT_RANK": "1"},  # dies in step 31: 30 done
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    recovery = summary["recovery"]
    assert recovery["resumed_from"] == "memory", (recovery, proc.stdout)
    # rank 1's write of step 30 may have been cut short by its death: then step 28 (the 2 newest are kept)
    assert recovery["disk_checkpoint_step"] == 20 and recovery["resumed_step"] in (28, 30), recovery
    assert recovery["steps_redone"] == 30 - recovery["resumed_step"], recovery
    assert summary["steps_done"] == 72 and summary["snapshot_every_steps"] == 2, summary
    assert_state_close(load_model(run_dir), reference, rtol=1e-5, atol=1e-8)
