import os
import signal
import subprocess
import sys

from ddpkit.launchers.elastic import interrupted
from ddpkit.training.signals import StopRequest, agreed_signal, hand_over, install_early, stopped_note
from ddpkit.util.envvars import AGENT_PID_VAR, ERROR_DIR_VAR


def test_the_first_signal_decides_and_later_ones_are_only_counted():
    before = signal.getsignal(signal.SIGUSR2)
    with StopRequest(["USR2", "TERM"]) as stop:
        assert stop.received is None and stop.wants_requeue  # nothing yet (or another rank's signal)
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGTERM)  # e.g. the scheduler's kill during the save: not fatal here
        os.kill(os.getpid(), signal.SIGUSR2)
        assert (stop.received, stop.repeats, stop.wants_requeue) == ("SIGUSR2", 2, True)
    assert signal.getsignal(signal.SIGUSR2) is before


def test_a_stop_by_sigterm_never_asks_for_a_requeue():
    with StopRequest(["usr2", "SIGTERM"]) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert (stop.received, stop.wants_requeue) == ("SIGTERM", False)


def test_a_signal_before_the_worker_installs_its_handlers_is_taken_over():
    before = signal.getsignal(signal.SIGUSR2)
    try:
        install_early(["USR2", "TERM"])  # as the CLI does in an srun task of `ddpkit slurm`'s script
        os.kill(os.getpid(), signal.SIGUSR2)  # torch is still loading: the worker has no handler yet
        with StopRequest(["USR2", "TERM"]) as stop:
            assert (stop.received, stop.wants_requeue) == ("SIGUSR2", True)
    finally:
        signal.signal(signal.SIGUSR2, before)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _over_ranks(received):
    """agreed_signal on each rank, for ranks whose first signals are `received`: the maximum of
    what each rank puts in, as the all-reduce gives every rank."""
    sent = []
    for r in received:
        agreed_signal(r, lambda v: sent.append(v) or v)
    return [agreed_signal(r, lambda v: max(sent)) for r in received]


def test_every_rank_agrees_on_the_signal_and_one_that_ends_the_job_wins_over_a_warning():
    # one pod evicted, another warned before its time limit, two whose processes received nothing
    assert _over_ranks([None, "SIGTERM", None, "SIGUSR2"]) == ["SIGTERM"] * 4
    assert _over_ranks([None, "SIGUSR2"]) == ["SIGUSR2"] * 2
    assert _over_ranks(["SIGINT", "SIGUSR1"]) == ["SIGINT"] * 2
    assert _over_ranks([None, None]) == [None, None]


def test_a_node_whose_processes_received_no_signal_hands_the_stop_to_its_launcher(tmp_path, monkeypatch):
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        monkeypatch.setenv(ERROR_DIR_VAR, str(tmp_path))
        monkeypatch.setenv(AGENT_PID_VAR, str(launcher.pid))
        summary = {"stopped_early": True, "stop_signal": "SIGTERM", "steps_done": 7}
        with StopRequest(["TERM"]) as stop:  # received nothing: another node's pod was evicted
            hand_over(stop, summary, local_rank=1)  # only the node's first worker speaks
            assert launcher.poll() is None and stopped_note(list(tmp_path.glob("attempt-*"))) is None
            hand_over(stop, summary, local_rank=0)
        assert launcher.wait(timeout=30) == -signal.SIGTERM
        note = stopped_note(list(tmp_path.glob("attempt-*")))
        assert note == {"signal": "SIGTERM", "steps_done": 7, "elsewhere": True}
        err = interrupted(signal.SIGTERM, tmp_path)
        assert (err.exit_code, err.saved_step) == (143, 7) and "another node received" in str(err)
    finally:
        launcher.kill()
        launcher.wait()


def test_a_node_that_received_the_signal_only_says_what_it_saved(tmp_path, monkeypatch):
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        monkeypatch.setenv(ERROR_DIR_VAR, str(tmp_path))
        monkeypatch.setenv(AGENT_PID_VAR, str(launcher.pid))
        with StopRequest(["TERM"]) as stop:
            os.kill(os.getpid(), signal.SIGTERM)  # from its launcher, which is stopping already
            hand_over(stop, {"stopped_early": True, "stop_signal": "SIGTERM", "steps_done": 3}, local_rank=0)
        assert launcher.poll() is None  # not signalled again
        err = interrupted(signal.SIGTERM, tmp_path)
        assert err.saved_step == 3 and str(err) == "stopped by SIGTERM; the workers were stopped"
    finally:
        launcher.kill()
        launcher.wait()
