"""The one error type a user can cause. The CLI prints its message without a traceback."""


class DdpkitError(Exception):
    """Bad input from the user (flags, environment, files): the message says what to do."""


class WorkerFailed(DdpkitError):
    """A worker of the job failed (its own exception, exit code or signal, a hang), not ddpkit's
    input: the CLI exits 1 for it (`train` and `launch` alike, as torchrun does), keeping 2 for
    usage errors."""

    exit_code = 1


class Interrupted(DdpkitError):
    """The command was stopped by a signal (Ctrl-C, a TERM from a scheduler or `kill`): the CLI
    exits 128 + the signal's number, the shell's convention (130 after SIGINT, 143 after SIGTERM)."""

    def __init__(self, signum: int, message: str, saved_step: int | None = None) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum
        self.saved_step = saved_step  # the workers saved a checkpoint at this step before they stopped


class RunDirTaken(DdpkitError):
    """Another world of the job (or another run) started training in this run's directory:
    this world stopped without writing more (checkpoint/world_mark.py). Its message opens with
    OPENING, by which a launcher knows it again from the text a worker left."""

    OPENING = "another world took over the run directory"


class Terminated(KeyboardInterrupt):
    """SIGTERM before a launch handles signals itself (the CLI's handler raises it): it unwinds as
    Ctrl-C's KeyboardInterrupt does, which nothing catches by accident; exit 143."""

    signum = 15
