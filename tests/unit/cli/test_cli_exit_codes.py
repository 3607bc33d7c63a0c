"""The command line's exit codes, by the shell's convention: 0 done, 1 a failure, 2 a usage error,
128 + N after signal N (130 Ctrl-C, 143 SIGTERM), for every command alike."""

import signal

import pytest

from ddpkit.cli import commands
from ddpkit.errors import DdpkitError, Interrupted, Terminated, WorkerFailed


@pytest.mark.parametrize(
    "raised, code, line",
    [
        (DdpkitError("bad --lr"), 2, "ddpkit: error: bad --lr"),
        (WorkerFailed("worker rank 1 exited with code 3"), 1, "ddpkit: error: worker rank 1 exited with code 3"),
        (Interrupted(signal.SIGINT, "stopped by SIGINT"), 130, "ddpkit: error: stopped by SIGINT"),
        (Interrupted(signal.SIGTERM, "stopped by SIGTERM"), 143, "ddpkit: error: stopped by SIGTERM"),
        (KeyboardInterrupt(), 130, "ddpkit: stopped by SIGINT"),
        (Terminated(), 143, "ddpkit: stopped by SIGTERM"),
    ],
)
def test_each_ending_has_its_code_and_one_line(monkeypatch, capsys, raised, code, line):
    def run(ns):
        raise raised

    monkeypatch.setitem(commands.COMMANDS, "env", commands.COMMANDS["env"].__class__(run, "", ""))
    assert commands.main(["env"]) == code
    assert capsys.readouterr().err.strip().splitlines() == [line]


def test_a_sigterm_unwinds_the_real_command_line_and_its_handler_is_put_back():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated), commands.terminated_as_interrupt(True):
        signal.raise_signal(signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is before
    with commands.terminated_as_interrupt(False):  # main() called from Python: the caller's handler stays
        assert signal.getsignal(signal.SIGTERM) is before
