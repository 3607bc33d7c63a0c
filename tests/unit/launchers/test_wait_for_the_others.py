"""A worker of `ddpkit launch` whose script returned waits for the other workers of its node
before its interpreter's teardown (script_guard.py): an abort there must not stop a rank at work."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ddpkit.launchers.script_guard import ScriptGuard
from ddpkit.util.envvars import RETURNED_FILE, STACKS_FILE, attempt_errors


@pytest.fixture
def guard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ScriptGuard:
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    attempt_errors(tmp_path, 0).mkdir(parents=True)
    return ScriptGuard(timeout=None, hang_timeout=None, hang_dir=None, error_dir=str(tmp_path), rank=0)


def _started(tmp_path: Path, rank: int, pid: int) -> None:
    (attempt_errors(tmp_path, 0) / STACKS_FILE.format(rank=rank)).write_text(f"{pid} 1\n")


def test_it_waits_until_the_other_rank_has_returned(tmp_path: Path, guard: ScriptGuard) -> None:
    _started(tmp_path, 1, os.getpid())  # alive: this process
    marker = attempt_errors(tmp_path, 0) / RETURNED_FILE.format(rank=1)
    threading.Timer(0.6, marker.touch).start()
    start = time.monotonic()
    guard.returned()
    assert time.monotonic() - start >= 0.6
    assert (attempt_errors(tmp_path, 0) / RETURNED_FILE.format(rank=0)).exists()


def test_a_rank_that_has_ended_is_not_waited_for(tmp_path: Path, guard: ScriptGuard) -> None:
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _started(tmp_path, 1, int(ended.stdout))  # exited and reaped
    (attempt_errors(tmp_path, 0) / STACKS_FILE.format(rank=2)).write_text("")  # not written yet
    start = time.monotonic()
    guard.returned()
    assert time.monotonic() - start < 5
