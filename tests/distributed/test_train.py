"""`ddpkit train` end to end through the real CLI: real worker processes started by torch's
elastic agent, a real gloo process group. Each test asserts results, not that it ran."""

import json
import re

import pytest
import torch

from conftest import assert_state_close, assert_state_equal, load_model, run_ddpkit
from ddpkit.tasks.wine import wine_model


@pytest.mark.parametrize("nproc", [1, 2])
def test_default_wine_job_trains_to_the_guides_accuracy_and_leaves_the_run_contract(tmp_path, nproc):
    run = tmp_path / "run"
    proc = run_ddpkit("train", "--nproc", str(nproc), "--run-dir", str(run))
    out = proc.stdout
    assert f"world size   {nproc} (1 node), backend {'gloo' if nproc > 1 else 'none'}, device cpu" in out
    assert f"global batch {32 * nproc} (32 per process), epochs 100/100" in out
    assert len(re.findall(r"^epoch +\d+/100  train_loss", out, re.M)) == 100
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_accuracy"] >= 0.97, summary
    # model.pt: a plain state_dict without `module.`, loadable into the unwrapped model
    state = load_model(run)
    assert not any(k.startswith("module.") for k in state)
    model = wine_model()
    model.load_state_dict(state)
    # metrics.jsonl: one object per epoch
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in lines] == list(range(1, 101))
    assert all({"train_loss", "eval_loss", "eval_accuracy"} <= r.keys() for r in lines)
    assert lines[-1]["train_loss"] < lines[0]["train_loss"]
    assert lines[-1]["eval_accuracy"] == summary["eval_accuracy"]
    # checkpoints at 50 and 100, none at epoch 0, and they hold the full state
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["epoch-000050.pt", "epoch-000100.pt"]
    ck = torch.load(run / "checkpoints" / "epoch-000100.pt", weights_only=True)
    assert ck["epoch"] == 100 and ck["samples"] == 0 and ck["global_batch"] == 32 * nproc and len(ck["rng"]) == nproc
    assert ck["optimizer"]["state"] and ck["config"]["batch_size"] == 32
    assert_state_equal(ck["model"], state)


@pytest.mark.parametrize("nproc, per_rank", [(2, 16), (3, 10)])
def test_n_ranks_equal_one_process_with_the_global_batch(tmp_path, nproc, per_rank):
    """The scale-out promise: same seed, same global batch -> same model, whatever nproc.
    With 3 x 10 the last global batch (142 = 4 x 30 + 22) is uneven: 8/7/7 samples."""
    common = ["--epochs", "8", "--seed", "3", "--save-every", "0", "--quiet"]
    run_ddpkit(
        "train", "--nproc", "1", "--batch-size", str(nproc * per_rank), "--run-dir", str(tmp_path / "one"), *common
    )
    run_ddpkit(
        "train", "--nproc", str(nproc), "--batch-size", str(per_rank), "--run-dir", str(tmp_path / "many"), *common
    )
    one, many = load_model(tmp_path / "one"), load_model(tmp_path / "many")
    assert_state_close(many, one, rtol=1e-5, atol=1e-6)
    assert not all(torch.equal(one[k], wine_model().state_dict()[k]) for k in one)  # it trained


def test_different_seeds_give_different_models(tmp_path):
    for seed in (1, 2):
        run_ddpkit(
            "train",
            "--nproc",
            "1",
            "--epochs",
            "2",
            "--seed",
            str(seed),
            "--save-every",
            "0",
            "--quiet",
            "--run-dir",
            str(tmp_path / str(seed)),
        )
    a, b = load_model(tmp_path / "1"), load_model(tmp_path / "2")
    assert not torch.equal(a["0.weight"], b["0.weight"])


@pytest.mark.parametrize("nproc", [1, 2])
def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, nproc, reference_run):
    common = ["--nproc", str(nproc), "--seed", "5", "--save-every", "2"]
    full = reference_run(*common, "--epochs", "6", "--quiet")  # with 2 processes also test_fsdp's DDP run
    run_ddpkit(
        "train", *common, "--epochs", "3", "--quiet", "--run-dir", str(tmp_path / "split")
    )  # stops after epoch 3
    proc = run_ddpkit("train", *common, "--epochs", "6", "--resume", "--run-dir", str(tmp_path / "split"))
    assert "resuming from" in proc.stdout and "epoch-000003.pt" in proc.stdout
    assert_state_equal(load_model(tmp_path / "split"), load_model(full))
    full = (full / "metrics.jsonl").read_text().splitlines()
    split = (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()

    def strip(lines):
        return [{k: v for k, v in json.loads(x).items() if k in ("epoch", "train_loss", "eval_loss")} for x in lines]

    assert strip(split) == strip(full)


def test_an_existing_run_is_not_overwritten_without_resume(tmp_path):
    run_ddpkit("train", "--nproc", "1", "--epochs", "1", "--quiet", "--run-dir", str(tmp_path))
    before = (tmp_path / "model.pt").read_bytes()
    proc = run_ddpkit("train", "--nproc", "1", "--epochs", "1", "--run-dir", str(tmp_path), check=False)
    assert proc.returncode == 2 and "pass --resume" in proc.stderr
    assert (tmp_path / "model.pt").read_bytes() == before


def test_user_task_file_trains(tmp_path, repo=None):
    from conftest import REPO

    run = tmp_path / "run"
    run_ddpkit(
        "train",
        str(REPO / "examples" / "user_task.py") + ":build",
        "--nproc",
        "2",
        "--epochs",
        "10",
        "--batch-size",
        "25",
        "--quiet",
        "--run-dir",
        str(run),
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["eval_accuracy"] >= 0.9


def test_module_function_task_trains(tmp_path):
    (tmp_path / "pkg_task_mod.py").write_text(
        "import torch\n"
        "def make():\n"
        "    m = torch.nn.Linear(3, 2)\n"
        "    ds = torch.utils.data.TensorDataset(torch.randn(20, 3), torch.randint(0, 2, (20,)))\n"
        "    return ds, m, torch.optim.SGD(m.parameters(), lr=0.1)\n"
    )
    run_ddpkit("train", "pkg_task_mod:make", "--nproc", "2", "--epochs", "2", "--quiet", "--run-dir", "r", cwd=tmp_path)
    assert set(load_model(tmp_path / "r")) == {"weight", "bias"}
