import os
import signal

from ddpkit.training.signals import StopRequest, install_early


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
