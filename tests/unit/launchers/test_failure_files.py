"""The launcher names the failure of the attempt that ended the job, never a file an earlier
attempt (before a --max-restarts restart) left in the same error folder."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from ddpkit.envvars import attempt_errors
from ddpkit.launchers.elastic import _failure_message, _user_error


class _Failed:
    """What torch's ChildFailedError answers to get_first_failure (rank, failure)."""

    def __init__(self, rank: int, exitcode: int) -> None:
        self.first = (rank, SimpleNamespace(exitcode=exitcode))

    def get_first_failure(self):
        return self.first


def _write(errors: Path, attempt: int, name: str, text: str) -> None:
    folder = attempt_errors(errors, attempt)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)


def test_an_earlier_attempts_user_error_is_not_reported(tmp_path: Path) -> None:
    _write(tmp_path, 0, "rank-1.txt", "attempt 0: bad --lr")
    _write(tmp_path, 0, "peer-0.txt", "rank 0 lost contact with another rank (attempt 0)")
    last = attempt_errors(tmp_path, 1)  # the final attempt's worker rank 0 was killed: no file of its own
    assert _user_error(last) is None
    assert _failure_message(_Failed(0, -9), last) == (
        "worker rank 0 was killed by signal 9; the other workers were stopped (see its output above)"
    )


def test_the_failing_attempts_files_are_reported(tmp_path: Path) -> None:
    _write(tmp_path, 0, "rank-0.txt", "attempt 0: bad --lr")
    _write(tmp_path, 2, "rank-3.txt", "attempt 2: no such file")
    _write(tmp_path, 2, "rank-2.txt", "attempt 2: the first rank's")
    _write(tmp_path, 2, "peer-1.txt", "rank 1 lost contact with another rank")
    last = attempt_errors(tmp_path, 2)
    assert _user_error(last) == "attempt 2: the first rank's"
    assert _failure_message(_Failed(1, 1), last).startswith("rank 1 lost contact with another rank; ")


def test_a_rank_whose_task_raised_is_named_with_its_exception_however_it_ended(tmp_path: Path) -> None:
    _write(tmp_path, 0, "raised-1.txt", "ValueError: bad batch on rank 1 (sample 7)\n")
    last = attempt_errors(tmp_path, 0)
    expected = (
        "worker rank 1 raised ValueError: bad batch on rank 1 (sample 7); the other workers were stopped "
        "(its traceback is above)"
    )
    assert _failure_message(_Failed(1, 1), last) == expected
    assert _failure_message(_Failed(1, -6), last) == expected  # an abort in its teardown after the exception
    assert _failure_message(_Failed(0, 1), last).startswith("worker rank 0 exited with code 1")


def test_another_ranks_failure_is_told_from_this_ranks_own() -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from ddpkit.worker import another_rank_failed

    lost = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:13023")
    try:
        try:
            raise lost
        except RuntimeError:
            raise SignalException("Process 7 got signal: 15", sigval=15) from None
    except SignalException as e:
        stopped = e
    assert another_rank_failed(stopped) == "stopped"
    assert another_rank_failed(lost) == "peer"
    assert another_rank_failed(ValueError("bad batch on rank 1")) is None
