"""The scale-out promise at the largest world this machine can hold: 32 processes at 2
samples each end at the model of one process at 64. On 2 cores the 32 workers are
oversubscribed 16 to a core, which is what finds per-rank costs that grow with the
world size (start-up, rendezvous, the shared-memory mapping, summaries)."""

import json

import pytest
import torch

from conftest import assert_state_close, load_model, run_ddpkit
from ddpkit.tasks.wine import wine_model

pytestmark = pytest.mark.serial  # 32 processes on this machine's cores: alone


@pytest.mark.slow
def test_world_32_at_batch_2_ends_at_world_1s_model_at_batch_64(tmp_path, reference_run):
    """Wine, 2 epochs (142 samples: steps of 64, 64, 14): the last step of each epoch gives 7
    ranks 2 samples and 25 ranks none, so ranks without data must still take part correctly."""
    common = ["--epochs", "2", "--seed", "3", "--save-every", "0", "--quiet"]
    one = load_model(reference_run("--nproc", "1", "--batch-size", "64", *common))
    run = tmp_path / "world32"
    run_ddpkit("train", "--nproc", "32", "--batch-size", "2", "--start-method", "fork", "--run-dir", str(run), *common)
    many = load_model(run)
    assert_state_close(many, one, rtol=1e-5, atol=1e-6)
    assert not all(torch.equal(one[k], wine_model().state_dict()[k]) for k in one)  # it trained
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 32 and summary["global_batch"] == 64 and summary["steps_done"] == 6
    assert len(summary["peak_memory_bytes"]) == 32  # every rank reported
