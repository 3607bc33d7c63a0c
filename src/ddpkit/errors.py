"""The one error type a user can cause. The CLI prints its message without a traceback."""


class DdpkitError(Exception):
    """Bad input from the user (flags, environment, files): the message says what to do."""


class WorkerFailed(DdpkitError):
    """A worker of the job failed (its own exception, exit code or signal), not ddpkit's input:
    `ddpkit launch` exits 1 for it, as torchrun does, keeping 2 for its own usage errors."""

    exit_code = 1
