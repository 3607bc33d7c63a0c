"""What a command is (Command: its help, the settings and options it takes, its handler) and the
parser made of a table of them, with a --config file's settings as the flags' defaults. Below
the command modules: `ddpkit slurm` parses the arguments of `ddpkit train` with it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from .. import config
from .flags import OneLineParser, add_config_flags, add_option_flags, engine_usage, flag_defaults

# The RunConfig groups of `ddpkit train` (and of check and verify, which take its flags)
ALL_GROUPS = (
    config.PROCESSES,
    config.NODES,
    config.TRAINING,
    config.FAULTS,
    config.OUTPUT,
    config.STRATEGY,
    config.PERFORMANCE,
)


@dataclass(frozen=True)
class Command:
    """A command of the CLI: what it does, the RunConfig settings it takes (whole groups or
    single fields, `defaults` for its own defaults of them) and its own options; `quick_exit`:
    the real command line ends its process at once when it is done (see commands.quick_exit);
    `engine`: an engine's command, `ddpkit NAME [NAME flags] -- TASK [train flags]` (the
    arguments after -- in ns.train_args, parsed by the engine as `ddpkit train`'s); `compact`: a
    long list of flags, one line each in --help, every flag's long text in --help-all (cli/help.py)."""

    run: Callable[[argparse.Namespace], int]
    help: str
    description: str
    groups: tuple[str, ...] = ()
    names: tuple[str, ...] = ()
    defaults: dict[str, Any] = field(default_factory=dict)
    options: type | None = None
    formatter: type[argparse.HelpFormatter] | None = None
    quick_exit: bool = False
    engine: bool = False
    compact: bool = False


def build_parser(
    commands: Mapping[str, Command], file_settings: dict[str, Any] | None = None
) -> argparse.ArgumentParser:
    """The parser of `commands`; `file_settings` (a --config file's) become the defaults of the
    flags, so a flag given on the command line wins over the file and a flag left out does not."""
    parser = OneLineParser(  # its subcommands' parsers too: a bad flag is one line, not the usage
        prog="ddpkit",
        allow_abbrev=False,
        description="Run a PyTorch training task on one process, every GPU of a node, or many nodes, with DDP, FSDP "
        "or HSDP.",
    )
    parser.set_defaults(cli_parser=parser)  # `ddpkit help COMMAND` prints a command's help from it
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in commands.items():
        p = sub.add_parser(
            name,
            help=command.help,
            description=command.description,
            formatter_class=command.formatter or argparse.HelpFormatter,
            allow_abbrev=False,  # `--bucket` is not --bucket-mb: a flag of another command, or a typo, is refused
            engine=command.engine,
            compact=command.compact,
            usage=engine_usage(f"ddpkit {name}") if command.engine else None,
        )
        if command.groups or command.names:
            defaults = {**command.defaults, **flag_defaults(file_settings or {})}
            add_config_flags(p, command.groups, names=command.names, defaults=defaults)
        if command.options is not None:
            add_option_flags(p, command.options)
    return parser


def parse_args(commands: Mapping[str, Command], argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, with a --config file read in between: parsed once to find the file,
    then again with the file's settings as the defaults. The file's settings that no flag of
    the command takes still reach its RunConfig (ns.file_settings, read by config_from)."""
    ns = build_parser(commands).parse_args(argv)
    path = getattr(ns, "config", None)
    if not path:
        return ns
    from ..config.file import read_config_file

    settings = read_config_file(path)
    given = ns  # the command line alone: which switches it turned on
    ns = build_parser(commands, settings).parse_args(argv)
    for pair in config.CONTRADICTIONS:
        for mine, theirs in (pair, pair[::-1]):
            if getattr(given, mine, None) is True and settings.get(theirs) is True and not getattr(given, theirs, None):
                setattr(ns, theirs, False)  # --verbose given over the file's quiet = true: the flag wins
    ns.file_settings = settings
    return ns
