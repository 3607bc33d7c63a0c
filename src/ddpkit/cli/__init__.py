"""The command line: dispatch and exit codes (commands.py), one module per command (train_cmd.py,
...: its help, options and handler), flags made from RunConfig (flags.py).
Imports no torch: `ddpkit --help` stays instant."""

from .commands import build_parser, main

__all__ = ["build_parser", "main"]
