"""How a run ended, from its folder: the newest attempt is the one whose config.json is on disk;
an end record (summary.json, failed.json) older than it belongs to an earlier attempt."""

import json
import os

import pytest

from ddpkit import DdpkitError
from ddpkit.errors import RunDirTaken
from ddpkit.reporting.run_state import FAILED_FILE, record_failure, run_state
from ddpkit.util.envvars import LAUNCH_ID_VAR


@pytest.fixture(autouse=True)
def _outside_a_launch(monkeypatch):
    """A caller outside `ddpkit train`: a test before this one in the same process may have
    called ddpkit.train, which names its launch in the environment."""
    monkeypatch.delenv(LAUNCH_ID_VAR, raising=False)


def _write(path, data, mtime):
    path.write_text(json.dumps(data))
    os.utime(path, (mtime, mtime))


def test_a_failure_is_recorded_only_for_a_run_that_started(tmp_path):
    record_failure(tmp_path, DdpkitError("refused before the start"))
    assert not (tmp_path / FAILED_FILE).exists()  # an earlier run in the folder stays as it was
    _write(tmp_path / "config.json", {}, 100)
    record_failure(tmp_path, RuntimeError("boom\nline two"))
    assert json.loads((tmp_path / FAILED_FILE).read_text())["error"] == "RuntimeError: boom"
    assert run_state(tmp_path) == {"state": "failed", "error": "RuntimeError: boom"}
    record_failure(tmp_path, DdpkitError("worker rank 1 exited with code 1"))
    assert run_state(tmp_path)["error"] == "RuntimeError: boom"  # the failing worker's own, written first
    os.utime(tmp_path / FAILED_FILE, (150, 150))
    _write(tmp_path / "config.json", {}, 200)  # the next attempt started
    record_failure(tmp_path, ValueError("bad label"), rank=1)
    assert run_state(tmp_path)["error"] == "rank 1: ValueError: bad label"


def test_the_newest_attempt_decides(tmp_path):
    assert run_state(tmp_path) == {"state": "running?"}
    _write(tmp_path / "config.json", {}, 100)
    _write(tmp_path / FAILED_FILE, {"error": "x"}, 150)
    _write(tmp_path / "summary.json", {"stopped_early": True}, 200)
    assert run_state(tmp_path)["state"] == "stopped"  # a summary of this attempt wins over a failure
    _write(tmp_path / "config.json", {}, 300)  # resumed: running, or killed without a word
    assert run_state(tmp_path) == {"state": "running?"}
    _write(tmp_path / "summary.json", {"stopped_early": False}, 400)
    assert run_state(tmp_path)["state"] == "finished"


def test_a_world_stopped_by_a_takeover_leaves_the_folder_to_the_world_that_took_it(tmp_path):
    _write(tmp_path / "config.json", {}, 100)  # the newer world's attempt
    record_failure(tmp_path, RunDirTaken(f"{RunDirTaken.OPENING} {tmp_path} ..."))
    assert run_state(tmp_path) == {"state": "running?"}  # the newer world is not failing


def test_a_run_stopped_by_a_signal_is_interrupted_not_failed(tmp_path):
    class Interrupted(DdpkitError):  # how a launcher may say it: the signal's number on the error
        signum = 15

    for error, name in (
        (KeyboardInterrupt(), "SIGINT"),
        (DdpkitError("stopped by SIGINT; the workers were stopped (with --save-on-signal they saved ...)"), "SIGINT"),
        (Interrupted("stopped by SIGTERM; the workers were stopped"), "SIGTERM"),
    ):
        folder = tmp_path / name / type(error).__name__
        folder.mkdir(parents=True)
        _write(folder / "config.json", {}, 100)
        record_failure(folder, error)
        assert run_state(folder) == {"state": "interrupted", "error": f"stopped by {name}"}


def test_a_launch_records_a_failure_only_in_a_folder_it_started_training_in(tmp_path, monkeypatch):
    from ddpkit.checkpoint.world_mark import WorldMark
    from ddpkit.util.envvars import LAUNCH_ID_VAR

    _write(tmp_path / "config.json", {}, 100)  # a finished run of an earlier launch
    _write(tmp_path / "summary.json", {"stopped_early": False}, 200)
    monkeypatch.setenv(LAUNCH_ID_VAR, "earlier")
    WorldMark(tmp_path, True, 2, 1).claim()
    monkeypatch.setenv(LAUNCH_ID_VAR, "this")
    record_failure(tmp_path, DdpkitError("--resume: checkpoint is of a different model"))  # refused before its start
    assert not (tmp_path / FAILED_FILE).exists() and run_state(tmp_path)["state"] == "finished"
    WorldMark(tmp_path, True, 2, 1).claim()  # this launch started: its failures are its own
    _write(tmp_path / "config.json", {}, 300)
    record_failure(tmp_path, DdpkitError("cannot write X: No space left on device"))
    assert run_state(tmp_path) == {"state": "failed", "error": "cannot write X: No space left on device"}
