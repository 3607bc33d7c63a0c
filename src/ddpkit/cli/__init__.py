"""The command line: dispatch and exit codes (commands.py), flags made from RunConfig (flags.py).
Imports no torch: `ddpkit --help` stays instant."""

from .commands import build_parser, main

__all__ = ["build_parser", "main"]
