"""How a section declares its settings (`setting`: the help, choices and default a flag and a
config file's key are made from) and what every section shares: its group title, the view of
a RunConfig it hands to its component (`Section.of`), and the small checks of single values."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import DdpkitError

# The groups of flags, as the CLI titles them (each command takes some of them, cli/flags.py);
# a config file's table is the title's first word ([faults], [nodes]: config/file.py).
PROCESSES = "processes"
NODES = "several nodes (run the same command on every node)"
TRAINING = "training"
FAULTS = "faults and signals"
OUTPUT = "output"
STRATEGY = "strategy and precision"
PERFORMANCE = "performance (see docs/performance.md)"

# What a fault or a signal does: the group of `ddpkit train --help` of the few settings of a section
# shown apart from the rest of it (`help_group`; the others are shown by their section: cli/help.py)
FAULT_HANDLING = "faults"


def setting(
    default: Any = None,
    help: str = "",
    *,
    group: str = TRAINING,
    choices: Sequence[str] | None = None,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    metavar: str | None = None,
    type: Any = None,
    default_help: str | None = None,
    positional: bool = False,
    nargs: str | None = "?",
    cli: bool = True,
    factory: Any = None,
    append: bool = False,
    help_group: str | None = None,
) -> Any:
    """A field with what the CLI needs to offer it as a flag: the help text, the choices and
    the default are written here once; cli/flags.py makes the flag from them (for RunConfig
    and for each command's own options, cli/NAME_cmd.py). `default_help` describes a default
    that is not a plain value ("one per GPU"); `append`: the flag may be repeated, its values
    collected in a list (RunConfig makes --task-arg's (key, value) pairs a dict); `nargs`: how
    many values a positional takes, as argparse counts them (None: exactly one); `help_group`:
    the group of --help it is listed in, where not its section's (cli/help.py)."""
    meta = {
        "help": help,
        "group": group,
        "choices": choices,
        "flag": flag,
        "aliases": aliases,
        "metavar": metavar,
        "type": type,
        "default_help": default_help,
        "positional": positional,
        "nargs": nargs,
        "cli": cli,
        "append": append,
        "help_group": help_group,
    }
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def flag_spellings(f: dataclasses.Field) -> tuple[str, ...]:
    """The spellings of a setting's flag: its own (--the-name by default), then its aliases (the
    CLI's flags, a config file's keys and the flags `ddpkit slurm` keeps out of a job all read them)."""
    return (f.metadata.get("flag") or "--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ()))


S = TypeVar("S", bound="Section")


@dataclass(frozen=True)
class Section:
    """One concern's settings (a frozen dataclass of `setting` fields, all of one group) and
    the check of their values that needs nothing outside them. RunConfig is the union of the
    sections; `cfg.faults` and the like are views, what a component is handed."""

    GROUP = ""  # the flags' group title (a class attribute, not a setting)

    @classmethod
    def of(cls: type[S], config: Any) -> S:
        """This section's settings of `config` (a RunConfig, or anything with them as attributes)."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})

    def check(self) -> None:
        """Refuse a value of this section that cannot work, in one line that says what to do."""


def positive(flag: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise DdpkitError(f"{flag} must be a positive integer, got {value!r}")


def choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise DdpkitError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
