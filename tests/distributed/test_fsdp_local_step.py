"""FSDP's optimizer steps on the local shards (strategies/local_step.py): the same numbers as
stepping the DTensors, and between steps the state is DTensors as before (sharded checkpoints)."""

import pytest
import torch

from conftest import REPO, assert_state_equal, run_ddpkit


@pytest.mark.slow  # one launch of 2 ranks, three FSDP trainings and a sharded save and load: 15-60 s
def test_the_local_step_equals_the_dtensor_step_and_checkpoints_as_before(tmp_path):
    script = REPO / "tests" / "distributed" / "scripts" / "local_step_parity.py"
    out = tmp_path / "out.pt"
    run_ddpkit("launch", "--nproc", "2", str(script), str(out), str(REPO / "examples"), str(tmp_path), cwd=tmp_path)
    r = torch.load(out, weights_only=False)
    assert_state_equal(r["local_step"], r["dtensor_step"])  # AdamW with decay groups, clipping: bit for bit
    assert r["state_kinds"] == ["DTensor"] and r["params_are_dtensors"]
    assert set(r["steps"]) == {4.0} and r["same_state"]
    assert r["wrapped"] and r["lbfgs_left_alone"]  # not elementwise: LBFGS keeps DTensor's step
    assert_state_equal(r["reloaded"], r["local_step"])
