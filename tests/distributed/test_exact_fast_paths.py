"""The fast paths that keep the result: a training set of tensors gathered on the device
(--data-on-device on) trains the model the host path (off) trains, bit for bit, on 2 processes;
--deterministic is on in every worker before the task is built and recorded in the summary and
config.json; the summary names the data path and whether the optimizer was fused."""

import json

from conftest import REPO, assert_state_equal, load_model, run_ddpkit

TASK = str(REPO / "tests" / "distributed" / "scripts" / "records_switches.py") + ":build"
COMMON = ("--nproc", "2", "--epochs", "3", "--batch-size", "16", "--save-every", "0", "--eval-every", "3")


def _train(tmp_path, name, *flags):
    seen = tmp_path / f"{name}-seen"
    seen.mkdir()
    run = tmp_path / name
    proc = run_ddpkit("train", TASK, *COMMON, "--task-arg", f"out={seen}", "--run-dir", str(run), *flags)
    summary = json.loads((run / "summary.json").read_text())
    ranks = [json.loads((seen / f"rank-{r}.json").read_text()) for r in range(2)]
    return run, proc.stdout, summary, ranks


def test_batches_on_the_device_train_the_host_paths_model_and_deterministic_is_on_in_every_worker(tmp_path):
    placed, out, summary, ranks = _train(
        tmp_path, "on", "--data-on-device", "on", "--deterministic", "--num-workers", "1"
    )
    host, _, host_summary, host_ranks = _train(tmp_path, "off", "--data-on-device", "off")
    assert_state_equal(load_model(placed), load_model(host))  # the same samples in the same order
    assert summary["eval_loss"] == host_summary["eval_loss"]
    assert (summary["data"], host_summary["data"]) == ("on device", "loader")
    assert summary["fused_optimizer"] is host_summary["fused_optimizer"] is False  # auto: a CPU keeps the task's
    assert "--num-workers 1 is not used: the training set is tensors, each batch one indexing op (on the device)" in out
    want = {"algorithms": True, "cudnn_deterministic": True, "cudnn_benchmark": False, "cublas_workspace": ":4096:8"}
    assert ranks == [want, want]
    assert summary["deterministic"] is True and host_summary["deterministic"] is False
    assert [r["algorithms"] for r in host_ranks] == [False, False]
    config = json.loads((placed / "config.json").read_text())
    assert (config["deterministic"], config["data_on_device"]) == (True, "on")
