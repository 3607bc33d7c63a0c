"""--activation-checkpointing on 2 ranks: the same model as without it under DDP and FSDP
(float64 SGD with dropout, bit-equal: the same arithmetic, the recomputation redraws the same
masks), and checkpoints cross between runs with and without it, whole and sharded."""

import pytest
import torch

from conftest import REPO, assert_state_equal, run_ddpkit


@pytest.mark.slow  # one launch of 2 ranks, 8 models wrapped: ~15 s alone, more on a loaded machine
def test_checkpointing_trains_the_same_model_under_ddp_and_fsdp_and_its_checkpoints_cross(tmp_path):
    script = REPO / "tests" / "distributed" / "scripts" / "activation_parity.py"
    out = tmp_path / "out.pt"
    run_ddpkit("launch", "--nproc", "2", str(script), str(out), str(REPO / "examples"), str(tmp_path), cwd=tmp_path)
    r = torch.load(out, weights_only=False)
    blocks = ["blocks.0", "blocks.1", "blocks.2"]
    assert r["checkpointed"] == {
        ("ddp", False): [],
        ("ddp", True): blocks,
        ("fsdp", False): [],
        ("fsdp", True): blocks,
    }
    state = r["state"]
    assert any((state["ddp", False][k] - r["init"][k]).abs().max() > 1e-3 for k in r["init"])  # it trained
    assert_state_equal(state["ddp", True], state["ddp", False])
    assert_state_equal(state["fsdp", True], state["fsdp", False])
    for variant, loaded in r["crossed"].items():  # saved with (without) it, loaded into a model without (with) it
        assert_state_equal(loaded, state[variant])
