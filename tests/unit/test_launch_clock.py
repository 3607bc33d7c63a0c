"""The run's clock (summary.json's wall time, the time ledger) starts at its launch: a second
ddpkit.train() in one process (a notebook) starts its own, and a time the command line or a
launcher set for this run is kept."""

import os
import time

import ddpkit
from ddpkit.util.envvars import LAUNCH_TIME_VAR


def test_each_train_call_of_a_process_starts_its_own_clock(monkeypatch, tmp_path):
    monkeypatch.delenv(LAUNCH_TIME_VAR, raising=False)
    ddpkit.train(task="wine", run_dir=str(tmp_path / "a"), dry_run=True)
    first = float(os.environ[LAUNCH_TIME_VAR])
    time.sleep(0.01)
    ddpkit.train(task="wine", run_dir=str(tmp_path / "b"), dry_run=True)
    assert float(os.environ[LAUNCH_TIME_VAR]) > first


def test_a_clock_the_command_line_started_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv(LAUNCH_TIME_VAR, "1234.5")  # set by `ddpkit train` before it parsed its flags
    ddpkit.train(task="wine", run_dir=str(tmp_path / "a"), dry_run=True)
    assert os.environ[LAUNCH_TIME_VAR] == "1234.5"
