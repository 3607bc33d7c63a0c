"""What `--help` shows: the flags in the groups a person looks for them in, each on one line
(its name, its value's shape and the start of its help), so that `ddpkit train --help` fits a
screen or two; `--help-all` (and `ddpkit help COMMAND`) is argparse's full text of every flag.

A setting's group is its config section's (config/*.py; a setting may name another with
`help_group`), so a setting added to a section lands in a group with nothing written here;
a section this table does not name is a group of its own, under its own title."""

from __future__ import annotations

import argparse
import re
import shutil
from typing import Any

from ..config.settings import FAULT_HANDLING, FAULTS, NODES, OUTPUT, PERFORMANCE, PROCESSES, STRATEGY, TRAINING

# The groups of --help, in their order, and the config sections each shows
HELP_GROUPS = {
    "the task and data": (TRAINING,),
    "processes and nodes": (PROCESSES, NODES),
    "strategy and mesh": (STRATEGY,),
    "checkpoints and resume": (FAULTS,),
    FAULT_HANDLING: (),
    "speed": (PERFORMANCE,),
    "output and trackers": (OUTPUT,),
}
_OF_SECTION = {section: title for title, sections in HELP_GROUPS.items() for section in sections}
ORDER = tuple(HELP_GROUPS)
OWN = ("positional arguments", "options")  # argparse's groups of a command's own arguments
NAME_WIDTH = 34  # the column the short help starts at
HELP_ALL = "--help-all"


def help_group(meta: Any) -> str:
    """The group of --help a setting is listed in ('' for a command's own options)."""
    section = meta.get("group") or ""
    return meta.get("help_group") or _OF_SECTION.get(section, section)


def group_rank(title: str) -> int:
    """Where a group comes in --help: the table's order, then any other section's."""
    return ORDER.index(title) if title in ORDER else len(ORDER)


class HelpAll(argparse.Action):
    """--help-all: every flag with its long text and default (argparse's own help), then exit."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: Any, ns: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        parser.print_help_all()
        parser.exit()


def compact_help(parser: argparse.ArgumentParser, width: int | None = None) -> str:
    """`parser`'s help with one line per flag: a usage line, the description, the groups."""
    width = width or max(80, min(shutil.get_terminal_size().columns, 120))
    prog, formatter = parser.prog, parser._get_formatter()
    positionals = [a for a in parser._actions if not a.option_strings and a.help != argparse.SUPPRESS]
    shapes = [f"[{_name(a)}]" if a.nargs in ("?", "*", argparse.REMAINDER) else _name(a) for a in positionals]
    every = f"ddpkit help {prog.split()[-1]}" if prog.startswith("ddpkit ") else ""
    lines = [
        "usage: " + (parser.usage or " ".join([prog, "[flags]", *shapes])),
        f"every flag with its long text and default: {prog} {HELP_ALL}" + (f" (or {every})" if every else ""),
        "",
    ]
    if parser.description:
        lines += [formatter._format_text(parser.description).rstrip("\n"), ""]
    for title, actions in _help_groups(parser).items():
        lines.append(f"{title}:")
        lines += [_one_line(a, formatter, width) for a in actions]
        lines.append("")
    return "\n".join(lines)


def _help_groups(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    """The parser's actions by their group of --help (a setting's, cli/flags.py; a command's own
    option: its argparse group): the command's own first, then the table's, then any other."""
    out: dict[str, list[argparse.Action]] = {}
    for group in parser._action_groups:
        for a in group._group_actions:
            if a.help != argparse.SUPPRESS:
                out.setdefault(getattr(a, "help_group", "") or group.title or "options", []).append(a)
    ranked = sorted(out, key=lambda t: (t not in OWN, group_rank(t)))
    return {t: out[t] for t in ranked}


def _one_line(action: argparse.Action, formatter: argparse.HelpFormatter, width: int) -> str:
    if not action.option_strings:
        name = _name(action)
    else:  # -h, --help; otherwise the flag's own spelling (its aliases and opposite: --help-all)
        short = [s for s in action.option_strings if not s.startswith("--")]
        name = ", ".join([*short, *[s for s in action.option_strings if s.startswith("--")][:1]])
        if action.nargs != 0:
            name += " " + _metavar(action)
    head = f"  {name}".ljust(NAME_WIDTH - 2) + "  "
    text = formatter._expand_help(action) if action.help else ""
    return head + short_help(text, max(width - len(head), 20))


def _name(positional: argparse.Action) -> str:
    return str(positional.metavar or positional.dest.upper())


def _metavar(action: argparse.Action) -> str:
    """The shape of a flag's value: its own metavar, its few choices, N for a count, else the
    last word of its name (--run-dir DIR, --lr LR, --tracker-uri URI)."""
    if action.metavar:
        return str(action.metavar)
    listed = "|".join(str(c) for c in action.choices or ())
    if listed and len(listed) <= 24:
        return listed
    if action.type is int:
        return "N"
    return action.dest.rsplit("_", 1)[-1].upper()


def short_help(text: str, room: int) -> str:
    """The gist of a help text in `room` characters: without its parentheses (asides, the
    default), up to its first '; ', then cut at a word."""
    text = " ".join(text.split())
    while True:
        shorter = re.sub(r" ?\([^()]*\)", "", text)
        if shorter == text:
            break
        text = shorter
    cut = text.find("; ", 12)
    if cut != -1:
        text = text[:cut]
    if len(text) <= room:
        return text
    return text[: room - 3].rsplit(" ", 1)[0].rstrip(",;:") + "..."
