"""The launcher names the failure of the attempt that ended the job, never a file an earlier
attempt (before a --max-restarts restart) left in the same error folder."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from ddpkit.launchers.report import RESUME_SCRIPT, RestartLine, after_return
from ddpkit.launchers.report import failure_message as _failure_message
from ddpkit.launchers.report import user_error as _user_error
from ddpkit.util.envvars import attempt_errors


class _Failed:
    """What torch's ChildFailedError answers to get_first_failure (rank, failure)."""

    def __init__(self, rank: int, exitcode: int, **others: int) -> None:
        self.first = (rank, SimpleNamespace(exitcode=exitcode, timestamp=100))
        self.failures = {
            rank: self.first[1],
            **{int(k[1:]): SimpleNamespace(exitcode=c, timestamp=100) for k, c in others.items()},
        }

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


def test_a_rank_that_died_on_its_own_is_named_before_the_rank_that_lost_contact_with_it(tmp_path: Path) -> None:
    """Both can end within one poll of the agent, which then calls the lower rank first."""
    _write(tmp_path, 1, "peer-0.txt", "rank 0 lost contact with another rank")
    last = attempt_errors(tmp_path, 1)
    assert _failure_message(_Failed(0, 1, r1=3), last) == (
        "worker rank 1 exited with code 3; the other workers were stopped (see its output above)"
    )
    # stopped by the agent (a signal) is no cause of its own: the lost contact is what is known
    assert _failure_message(_Failed(0, 1, r1=-15), last).startswith("rank 0 lost contact with another rank; ")


class _Failure(SimpleNamespace):
    """What torch's ProcessFailure answers to: the exit code (-N: killed by signal N) and when."""


def _failures(**codes: int) -> dict[int, _Failure]:
    return {int(name[1:]): _Failure(exitcode=code, timestamp=100) for name, code in codes.items()}


def _started(errors: Path, attempt: int, ranks: range, returned: tuple[int, ...]) -> Path:
    # what a launch's bootstrap leaves: its stacks file when it starts, a mark when the script returned
    for rank in ranks:
        _write(errors, attempt, f"stacks-{rank}.txt", "1 2\n")
    for rank in returned:
        _write(errors, attempt, f"returned-{rank}", "")
    return attempt_errors(errors, attempt)


def test_an_abort_after_every_script_returned_is_named_and_ends_nothing(tmp_path: Path) -> None:
    folder = _started(tmp_path, 0, range(2), returned=(0, 1))
    line, unfinished = after_return(_failures(r1=-6), folder)
    assert line == "rank 1 aborted in torch's shutdown after the script finished (signal 6)" and unfinished == []


def test_an_abort_after_return_while_another_rank_worked_leaves_that_rank_unfinished(tmp_path: Path) -> None:
    folder = _started(tmp_path, 0, range(2), returned=(1,))
    assert after_return(_failures(r1=-6, r0=-15), folder) == (
        "rank 1 aborted in torch's shutdown after the script finished (signal 6)",
        [0],
    )
    assert after_return(_failures(r1=-6, r0=-11), folder) is None  # rank 0 crashed by itself: a failure of its own
    assert after_return(_failures(r0=-6), folder) is None  # rank 0 had not returned: the script failed


def test_a_restart_line_says_which_rank_failed_how_and_what_the_restarted_workers_do(tmp_path: Path) -> None:
    line = RestartLine(RESUME_SCRIPT, tmp_path)
    failures = {1: _Failure(exitcode=-9, timestamp=100), 0: _Failure(exitcode=-15, timestamp=100)}
    assert line.failed(failures, 1, 1) == (
        "ddpkit: worker rank 1 was killed by signal 9; restarting the workers, attempt 2 of 2: the script "
        "starts again from its beginning (it continues where it stopped only if it loads its own checkpoint)"
    )
    _write(tmp_path, 1, "rank-0.txt", "bad --lr")  # the failing attempt's own words
    failures = {0: _Failure(exitcode=2, timestamp=100)}
    assert line.failed(failures, 2, 3).startswith("ddpkit: worker rank 0 exited with code 2 (bad --lr); ")
    assert "attempt 3 of 4" in line.failed(failures, 2, 3)


def test_a_rank_killed_from_outside_is_named_before_the_rank_that_then_lost_it(tmp_path: Path) -> None:
    """A launched script writes no peer file: rank 0's lost connection (exit 1, its error file dated
    a second before the agent saw rank 1's SIGKILL) is what rank 1's death did to it."""
    line = RestartLine(RESUME_SCRIPT, tmp_path)
    failures = {0: _Failure(exitcode=1, timestamp=99), 1: _Failure(exitcode=-9, timestamp=100)}
    assert line.failed(failures, 1, 1).startswith("ddpkit: worker rank 1 was killed by signal 9; restarting")
    failures[1] = _Failure(exitcode=-11, timestamp=100)  # a crash too
    assert line.failed(failures, 1, 1).startswith("ddpkit: worker rank 1 was killed by signal 11; ")
    failures[1] = _Failure(exitcode=-9, timestamp=140)  # the agent's SIGKILL 30 s after its SIGTERM: a stop
    assert line.failed(failures, 1, 1).startswith("ddpkit: worker rank 0 exited with code 1; ")
    last = attempt_errors(tmp_path, 0)
    assert _failure_message(_Failed(0, 1, r1=-9), last) == (
        "worker rank 1 was killed by signal 9; the other workers were stopped (see its output above)"
    )
    assert _failure_message(_Failed(0, 1, r1=-15), last).startswith("worker rank 0 exited with code 1; ")


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

    from ddpkit.run.worker import another_rank_failed

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
