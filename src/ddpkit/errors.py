"""The one error type a user can cause. The CLI prints its message without a traceback."""


class DdpkitError(Exception):
    """Bad input from the user (flags, environment, files): the message says what to do."""
