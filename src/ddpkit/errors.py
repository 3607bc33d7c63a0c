"""The one error type a user can cause. The CLI prints its message without a traceback."""


class DdpkitError(Exception):
    """Bad input from the user (flags, environment, files): the message says what to do."""


class WorkerFailed(DdpkitError):
    """A worker of the job failed (its own exception, exit code or signal), not ddpkit's input:
    `ddpkit launch` exits 1 for it, as torchrun does, keeping 2 for its own usage errors."""

    exit_code = 1


class RunDirTaken(DdpkitError):
    """Another world of the job (or another run) started training in this run's directory:
    this world stopped without writing more (checkpoint/world_mark.py). Its message opens with
    OPENING, by which a launcher knows it again from the text a worker left."""

    OPENING = "another world took over the run directory"
