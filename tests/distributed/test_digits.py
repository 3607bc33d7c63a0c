"""The second built-in task: a small CNN on sklearn's bundled 8x8 digits, through the CLI."""
import json

import torch
from torch import nn

from conftest import assert_state_close, load_model, run_ddpkit
from ddpkit.task import build_task
from ddpkit.tasks.digits import digits_model


def test_digits_task_is_a_fixed_split_of_images_and_a_cnn():
    a, b = build_task("digits"), build_task("digits")
    x, y = a.train_set.tensors
    assert x.shape == (1437, 1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert len(a.eval_set) == 360 and 0.0 <= x.min() and x.max() <= 1.0
    assert torch.equal(x, b.train_set.tensors[0]) and torch.equal(a.eval_set.tensors[1], b.eval_set.tensors[1])
    assert sorted(y.unique().tolist()) == list(range(10))
    assert sum(isinstance(m, nn.Conv2d) for m in a.model) == 2
    assert a.model(x[:4]).shape == (4, 10)


def test_digits_reaches_95_percent_on_2_processes_and_equals_1_process_with_the_global_batch(tmp_path):
    common = ["--epochs", "8", "--seed", "0", "--save-every", "0", "--threads", "1"]
    proc = run_ddpkit("train", "digits", "--nproc", "2", "--batch-size", "32", "--run-dir", str(tmp_path / "two"), *common)
    assert "world size   2 (1 node), backend gloo" in proc.stdout
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["eval_accuracy"] >= 0.95, summary
    run_ddpkit("train", "digits", "--nproc", "1", "--batch-size", "64", "--quiet", "--run-dir", str(tmp_path / "one"), *common)
    one, two = load_model(tmp_path / "one"), load_model(tmp_path / "two")
    # 8 epochs x 23 Adam steps through two convolutions: float rounding grows a little more than Wine's
    assert_state_close(two, one, rtol=1e-5, atol=1e-5)
    model = digits_model()
    model.load_state_dict(one)
    assert not torch.equal(one["0.weight"], digits_model().state_dict()["0.weight"])  # it trained
