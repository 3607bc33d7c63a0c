"""A run's config.json replays it bit for bit (`ddpkit train --config`), and `ddpkit runs`
tells how each run of a folder ended: finished, stopped by a signal, failed, with its figures."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, assert_state_equal, load_model, run_ddpkit
from ddpkit.cli import main

TASKS = REPO / "tests" / "distributed" / "scripts" / "run_endings.py"
REFERENCE = ("--nproc", "2", "--seed", "5", "--save-every", "2", "--epochs", "6", "--quiet")  # test_train's too


@pytest.fixture(scope="module")
def runs(tmp_path_factory, reference_run):
    """A folder with a replay of the reference run, a run by --max-steps, a run stopped by a
    signal and a run whose task raised; and the reference run."""
    folder = tmp_path_factory.mktemp("runs")
    reference = reference_run(*REFERENCE)
    run_ddpkit("train", "--config", str(reference / "config.json"), "--run-dir", str(folder / "replay"))
    one = ("--nproc", "1", "--quiet", "--epochs", "3")
    run_ddpkit("train", *one, "--max-steps", "5", "--run-dir", str(folder / "steps"))
    run_ddpkit("train", f"{TASKS}:signals_itself", *one, "--save-on-signal", "USR1", "--run-dir", str(folder / "stop"))
    failed = run_ddpkit("train", f"{TASKS}:fails_at_step_3", *one, "--run-dir", str(folder / "failed"), check=False)
    assert failed.returncode != 0 and "third call" in failed.stderr
    _ctrl_c(folder / "interrupted")
    return folder, reference


def _ctrl_c(run):
    """A run on 2 processes, without --save-on-signal, stopped by Ctrl-C after its first epoch."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "train", "--nproc", "2", "--epochs", "1000", "--quiet", "--run-dir", str(run)],
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: the launcher and every worker
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow  # with the module's five runs (the reference run is shared with test_train)
def test_a_runs_config_json_replays_it_bit_for_bit(runs):
    folder, reference = runs
    assert_state_equal(load_model(folder / "replay"), load_model(reference))
    replayed = json.loads((folder / "replay" / "config.json").read_text())
    assert replayed == {**json.loads((reference / "config.json").read_text()), "run_dir": str(folder / "replay")}


@pytest.mark.slow
def test_runs_tells_how_each_run_ended(runs, capsys):
    folder, reference = runs
    assert main(["runs", str(folder), "--json"]) == 0
    found = {r["run"]: r for r in json.loads(capsys.readouterr().out)}
    assert sorted(found) == ["failed", "interrupted", "replay", "steps", "stop"]
    summary = json.loads((reference / "summary.json").read_text())
    replay = found["replay"]
    assert (replay["state"], replay["world_size"], replay["strategy"], replay["resumable"]) == (
        "finished",
        2,
        "ddp",
        True,
    )
    assert (replay["steps_done"], replay["train_loss"]) == (summary["steps_done"], summary["train_loss"])
    assert replay["checkpoint"].endswith("epoch-000006.pt")
    steps = found["steps"]  # --max-steps is the run's planned end: it finishes (model.pt, "run finished")
    assert (steps["state"], steps["steps_done"], steps["steps_planned"]) == ("finished", 5, 5)
    stop = found["stop"]  # stopped by its signal after epoch 1, inside epoch 2, with a checkpoint
    assert (stop["state"], stop["epochs_done"], stop["resumable"]) == ("stopped", 1, True)
    assert "-step-" in stop["checkpoint"]
    failed = found["failed"]
    assert (failed["state"], failed["resumable"]) == ("failed", False)
    assert failed["error"] == "RuntimeError: the task's loss failed at its third call"
    interrupted = found["interrupted"]  # Ctrl-C without --save-on-signal: stopped, not failed
    assert (interrupted["state"], interrupted["error"]) == ("interrupted", "stopped by SIGINT")

    assert main(["runs", str(folder)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == [
        "RUN", "TASK", "WORLD", "STRATEGY", "STEPS", "TRAIN", "EVAL", "COMPUTE", "TOP", "LOSS", "STATE", "RESUME"
    ]  # fmt: skip
    assert all(len(line) <= 112 for line in table)
    rows = {line.split()[0]: line.split() for line in table[1:6]}
    replayed = json.loads((folder / "replay" / "summary.json").read_text())  # its timings are its own
    assert rows["replay"][1:] == ["wine", "2", "ddp", f"{summary['steps_done']}/{summary['steps_done']}"] + [
        f"{summary['train_loss']:.4f}",
        f"{summary['eval_loss']:.4f}",
        f"{replayed['time']['percent']['compute']:.0f}%",  # where the replay's own time went (the ledger)
        *top_loss_cell(replayed),
        "finished",
        "yes",
    ]
    assert rows["stop"][-2:] == ["stopped", "yes"] and rows["failed"][-2:] == ["failed", "no"]
    assert rows["interrupted"][-2] == "interrupted"
    assert table[-2:] == ["failed:", "  failed: RuntimeError: the task's loss failed at its third call"]


def test_runs_of_an_empty_or_a_missing_folder(tmp_path, capsys):
    assert main(["runs", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"ddpkit: no runs in {tmp_path}\n"
    assert main(["runs", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such folder" in err


def top_loss_cell(summary):
    """The TOP LOSS cell of `ddpkit runs`: the part that took the most time after compute."""
    from ddpkit.reporting.summary import top_loss

    part, percent = top_loss(summary["time"])
    return [part, f"{percent:.0f}%"]
