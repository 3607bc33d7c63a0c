"""`ddpkit help COMMAND`: every flag of a command with its long text and default (its --help-all)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..errors import DdpkitError
from .options import option
from .parser import Command

HELP_HELP = """Print every flag of COMMAND with its long text and default: what `ddpkit COMMAND --help-all`
prints (`ddpkit COMMAND --help` lists each flag on one line). Without COMMAND, the commands."""


@dataclass(frozen=True)
class HelpOptions:
    name: str | None = option(help="the command", positional=True, metavar="COMMAND")


def cmd_help(ns: argparse.Namespace) -> int:
    parser = ns.cli_parser
    commands = next(a for a in parser._actions if a.dest == "command").choices
    if ns.name is None:
        parser.print_help()
    elif ns.name not in commands:
        raise DdpkitError(f"no command {ns.name!r}: the commands are {', '.join(commands)}")
    elif getattr(commands[ns.name], "compact", False):
        commands[ns.name].print_help_all()
    else:
        commands[ns.name].print_help()
    return 0


COMMAND = Command(cmd_help, "every flag of a command with its long text and default", HELP_HELP, options=HelpOptions)
