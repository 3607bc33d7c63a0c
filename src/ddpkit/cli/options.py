"""What each command's own flags are made of, beside the RunConfig settings it takes: one small
dataclass per command, in the command's module (cli/train_cmd.py, ...), every field an
`option(...)` with its help, choices and default written once (cli/flags.py makes the flags).
A field without a group is listed under the command's "options"; `positional` fields are its
arguments."""

from __future__ import annotations

from typing import Any

from ..config.settings import setting

PLAN_ONLY = "print the launch plan (nodes, ranks, master, backend, device) and start nothing"
CONFIG_HELP = (
    "read settings from a TOML, YAML or JSON file (keys as the flags or the field names; a run's "
    "config.json replays it); flags given here win over the file (--no-X turns a file's X off; "
    "--verbose wins over the file's quiet)"
)


def config_option() -> Any:
    """--config FILE: a command's settings from a file (config/file.py)."""
    return option(help=CONFIG_HELP, metavar="FILE")


def option(default: Any = None, help: str = "", *, group: str = "", **kwargs: Any) -> Any:
    """A setting of the command itself (by default in the "options" section of its --help)."""
    return setting(default, help, group=group, **kwargs)
