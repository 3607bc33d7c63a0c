"""What a user watches (progress on a terminal) and keeps (metrics.csv, TensorBoard, the hook)."""

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest

from conftest import REPO


def run_on_a_terminal(*args, cwd, timeout=120):
    """`python -m ddpkit ARGS` with stdout on a pseudo-terminal of 120 columns, as in a shell."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", *args],
        cwd=cwd,
        stdout=slave,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: every writer has closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    stderr = proc.communicate(timeout=timeout)[1].decode()
    return proc.returncode, b"".join(chunks).decode(errors="replace"), stderr


HOOKED = """
import json, os
from ddpkit.tasks.wine import build as wine

def build(config):
    task = wine(config)
    def on_metrics(record):
        with open(f"hook-rank{os.environ['RANK']}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\\n")
    task.on_metrics = on_metrics
    return task
"""


@pytest.fixture(scope="module")
def terminal_run(tmp_path_factory):
    """One Wine run on a terminal with a metric hook, --csv and --tensorboard, for both tests
    below: (its folder, exit code, terminal output, stderr); the run is in folder/run."""
    folder = tmp_path_factory.mktemp("terminal")
    (folder / "hooked.py").write_text(HOOKED)
    args = ["train", "hooked.py:build", "--nproc", "2", "--epochs", "4", "--eval-every", "2", "--save-every", "0"]
    return (folder, *run_on_a_terminal(*args, "--csv", "--tensorboard", "--run-dir", str(folder / "run"), cwd=folder))


def test_on_a_terminal_rank_0_draws_a_bar_with_global_loss_samples_per_s_and_eta(terminal_run):
    pytest.importorskip("tqdm")  # an optional extra; without it the bar falls back to lines (unit-tested)
    folder, rc, out, err = terminal_run
    assert rc == 0, err
    assert "epochs: 100%" in out and "4/4" in out  # the bar over epochs
    assert "epoch 4/4: " in out and "sample/s" in out  # the bar over this epoch's samples
    assert "rank0_loss" in out  # labelled as rank 0's running loss
    final = json.loads((folder / "run" / "summary.json").read_text())
    assert f"loss={final['train_loss']:.4f}" in out  # the global mean on the epoch bar
    assert out.count("epoch 1/4  train_loss") == 1  # rank 1 is silent
    assert "ddpkit: run finished" in out


def test_csv_tensorboard_and_the_metric_hook_get_the_same_global_values(terminal_run):
    tb = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    tmp_path, rc, _, err = terminal_run
    assert rc == 0, err
    run = tmp_path / "run"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2, 3, 4] and "eval_accuracy" not in records[0]
    # the hook: rank 0 only, once per epoch, exactly the records of metrics.jsonl (reduced across ranks)
    assert not (tmp_path / "hook-rank1.jsonl").exists()
    assert [json.loads(x) for x in (tmp_path / "hook-rank0.jsonl").read_text().splitlines()] == records
    # CSV: a column for every key (eval_* appeared in epoch 2), empty where there was no eval
    rows = (run / "metrics.csv").read_text().splitlines()
    assert rows[0] == "epoch,step,train_loss,epoch_s,samples_per_s,tflops_per_device,lr,eval_loss,eval_accuracy"
    assert len(rows) == 5 and rows[1].endswith(",,") and rows[2].split(",")[0] == "2"
    assert float(rows[4].split(",")[2]) == records[3]["train_loss"]
    # TensorBoard: the same values, at the optimizer step (as MLflow and W&B), the epoch beside them
    acc = tb.EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tags = {"loss/train", "loss/eval", "eval/accuracy", "perf/samples_per_s", "perf/tflops_per_device"}
    assert tags <= set(acc.Tags()["scalars"])
    train = acc.Scalars("loss/train")
    assert [e.step for e in train] == [r["step"] for r in records]
    assert [e.value for e in train] == pytest.approx([r["train_loss"] for r in records], rel=1e-6)
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [records[1]["step"], records[3]["step"]]
    assert [e.value for e in acc.Scalars("run/epoch")] == [1, 2, 3, 4]
