"""Flags made from `setting(...)` fields: a flag's help, choices and default are written once,
on the field (RunConfig's sections in config/, each command's own options in its module, cli/NAME_cmd.py). Each
command takes the RunConfig groups (or single fields) it needs, and its own options."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import shlex
import sys
from typing import Any, Callable, Iterable

from ..config import RunConfig
from ..config.settings import flag_spellings
from ..environments.registry import launcher_defaults
from .help import HELP_ALL, HelpAll, compact_help, help_group

_FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag or value is one line (what was wrong, where the flags are
    listed) and exit 2, not the command's whole usage above it. With `engine`, the parser of an
    engine's command (`ddpkit slurm|k8s|sky|ray`): its own flags come first, then --, then the
    task and the flags of `ddpkit train` exactly as they would follow `ddpkit train`
    (ns.train_args); a task or a flag of `ddpkit train` before the -- is refused in one line that
    shows the command in that order, never read with a second meaning."""

    def __init__(self, *args: Any, engine: bool = False, compact: bool = False, **kwargs: Any) -> None:
        self.engine, self.compact = engine, compact
        super().__init__(*args, **kwargs)
        if compact:  # --help: one line per flag (cli/help.py); --help-all: argparse's full text
            self.add_argument(HELP_ALL, action=HelpAll, help="every flag with its long text and default")

    def format_help(self) -> str:
        return compact_help(self) if self.compact else super().format_help()

    def print_help_all(self) -> None:
        """argparse's help: every flag with its long text and default."""
        self._print_message(super().format_help(), sys.stdout)

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if not self.engine:
            return super().parse_known_args(args, namespace)
        args = list(sys.argv[1:] if args is None else args)
        cut = args.index("--") if "--" in args else len(args)
        ns, extras = super().parse_known_args(args[:cut], namespace)
        if extras:
            unknown = [a for a in extras if _is_flag(a) and a.partition("=")[0] not in train_flags()]
            if unknown:
                self.error(f"unrecognized arguments: {' '.join(unknown)}")
            self.exit(2, f"{self.prog}: error: {misplaced(self.prog, args[:cut], extras, args[cut + 1 :])}\n")
        ns.train_args = args[cut + 1 :]
        return ns, []


ENGINE_RULE = (  # in the engines' help, as their descriptions are written: lines of at most 96
    "The engine's flags first, then --, then the task and the flags of `ddpkit train`, exactly as\n"
    "they would follow `ddpkit train`."
)


def engine_usage(prog: str) -> str:
    """The one rule of every engine's command line, in the words of its usage and docs."""
    return f"{prog} [{prog.split()[-1]} flags] -- TASK [train flags]"


def misplaced(prog: str, own: list[str], extras: list[str], after: list[str]) -> str:
    """The refusal of a task or `ddpkit train` flags (`extras`) among an engine command's own
    flags (`own`, before any --), with the command written the one way it is read."""
    kept, pending = [], list(extras)
    for a in own:  # `own` less `extras`, in order
        if pending and a == pending[0]:
            pending.pop(0)
        else:
            kept.append(a)
    line = shlex.join([*prog.split(), *kept, "--", *extras, *after])
    return f"the task and the flags of `ddpkit train` go after -- ({engine_usage(prog)}): {line}"


def _is_flag(arg: str) -> bool:
    return arg.startswith("--") or (arg[:1] == "-" and arg[1:2].isalpha())


@functools.lru_cache(maxsize=1)
def train_flags() -> frozenset[str]:
    """Every spelling of the flags `ddpkit train` takes (its settings, their opposites, its options)."""
    out = {"--config", "--dry-run"}
    for f in dataclasses.fields(RunConfig):
        if f.metadata.get("cli", True):
            out.update(names_of(f))
            if isinstance(f.default, bool):
                out.add(opposite(names_of(f)[0]))
    return frozenset(out)


def add_config_flags(
    parser: argparse.ArgumentParser,
    groups: Iterable[str] = (),
    names: Iterable[str] = (),
    defaults: dict[str, Any] | None = None,
) -> None:
    """Add the flags of every RunConfig field in `groups` and of the fields `names`, under
    their group's title; `defaults` overrides a field's default for this command."""
    wanted_groups, wanted_names = set(groups), set(names)
    # a launcher that starts this command on every node says its node flags (Kubeflow's PET_*, as torchrun
    # reads them; SkyPilot's SKYPILOT_*): its variables are their defaults
    defaults = {**launcher_defaults(os.environ), **(defaults or {})}
    fields = [
        f for f in dataclasses.fields(RunConfig) if f.name in wanted_names or f.metadata.get("group") in wanted_groups
    ]
    add_flags(parser, fields, defaults)


def add_option_flags(parser: argparse.ArgumentParser, options: type) -> None:
    """Add the flags of a command's own options (a dataclass of `setting(...)` fields)."""
    add_flags(parser, dataclasses.fields(options), opposites=False)


def add_flags(
    parser: argparse.ArgumentParser,
    fields: Iterable[dataclasses.Field],
    defaults: dict[str, Any] | None = None,
    opposites: bool = True,
) -> None:
    """One argparse argument per field: positionals first-class, the others under their group's
    title (a field without a group goes to the command's own "options"); each action knows its
    group of the one-line --help (cli/help.py: its section's, or its `help_group`). With `opposites`
    every boolean flag comes with its opposite (--csv and --no-csv), so that a config file's
    setting can be switched off on the command line."""
    titles: dict[str, Any] = {}
    for f in fields:
        meta = f.metadata
        if not meta.get("cli", True):
            continue
        default = (defaults or {}).get(f.name, None if meta.get("append") else f.default)
        if meta.get("positional"):
            parser.add_argument(f.name, **_positional_kwargs(meta, default)).help_group = help_group(meta)
            continue
        target: Any = parser
        if meta["group"]:
            if meta["group"] not in titles:
                titles[meta["group"]] = parser.add_argument_group(meta["group"])
            target = titles[meta["group"]]
        names, kwargs = names_of(f), _argparse_kwargs(f, default)
        if opposites and isinstance(f.default, bool):
            names, kwargs["action"], kwargs["on"] = (*names, opposite(names[0])), _Switch, not f.default
        target.add_argument(*names, **kwargs).help_group = help_group(meta)


def flag_names(name: str) -> tuple[str, ...]:
    """The spellings of a RunConfig field's flag."""
    return names_of(_FIELDS[name])


def names_of(f: dataclasses.Field) -> tuple[str, ...]:
    """The spellings of a field's flag: its own (--the-name by default), then its aliases."""
    return flag_spellings(f)


def opposite(flag: str) -> str:
    """The flag that undoes a boolean flag: --no-csv for --csv, --shuffle for --no-shuffle."""
    return "--" + flag.removeprefix("--no-") if flag.startswith("--no-") else "--no-" + flag.removeprefix("--")


class _Switch(argparse.Action):
    """A boolean flag and its opposite in one argument: the flag always sets the value it
    names and its opposite the other, whatever the default (a config file's setting) is."""

    def __init__(self, option_strings: list[str], dest: str, on: bool = True, **kwargs: Any) -> None:
        self.on = on
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: Any, ns: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        setattr(ns, self.dest, self.on if option_string in self.option_strings[:-1] else not self.on)


def _positional_kwargs(meta: Any, default: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"help": meta["help"]}
    if meta["nargs"] is not None:
        kwargs["nargs"] = meta["nargs"]
    if meta["nargs"] in ("?", "*"):  # may be left out: then the field's default
        kwargs["default"] = default
    if meta.get("metavar"):
        kwargs["metavar"] = meta["metavar"]
    return kwargs


def _argparse_kwargs(f: dataclasses.Field, default: Any) -> dict[str, Any]:
    meta = f.metadata
    kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": meta["help"] + _default_text(meta, default)}
    if isinstance(f.default, bool):  # what the flag means is the field's, not this default's (a file's)
        kwargs["action"] = "store_false" if f.default else "store_true"
        return kwargs
    kind = meta.get("type") or (type(f.default) if f.default not in (None, dataclasses.MISSING) else type(default))
    if kind is type(None):  # no default value to tell the type: text
        kind = str
    kwargs["type"] = _argparse_type(kind) if kind not in (int, float, str) else kind
    if meta.get("append"):
        kwargs["action"] = "append"  # a list of the values; RunConfig makes --task-arg's pairs a dict
    if meta.get("choices"):
        kwargs["choices"] = meta["choices"]
    if meta.get("metavar"):
        kwargs["metavar"] = meta["metavar"]
    return kwargs


def _default_text(meta: Any, default: Any) -> str:
    if meta.get("default_help"):
        return f" (default {meta['default_help']})"
    if default is None or isinstance(default, bool) or default == "":
        return ""
    return f" (default {default:g})" if isinstance(default, float) else f" (default {default})"


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """A parser whose ValueError becomes argparse's own message for the flag."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = parse.__name__
    return convert


def flag_defaults(settings: dict[str, Any]) -> dict[str, Any]:
    """A config file's settings as the defaults of their flags: a repeatable flag's default is
    the list its values are appended to (--task-arg on the command line adds to the file's)."""
    return {
        k: (list(v.items()) if isinstance(v, dict) else list(v)) if _FIELDS[k].metadata.get("append") else v
        for k, v in settings.items()
    }


def config_from(ns: argparse.Namespace, **changes: Any) -> RunConfig:
    """The RunConfig of the flags a command parsed, over the settings of its --config file that
    no flag of the command takes (the others keep their default)."""
    values = {name: getattr(ns, name) for name in _FIELDS if hasattr(ns, name)}
    values = {k: v for k, v in values.items() if not (v is None and _FIELDS[k].metadata.get("append"))}
    return RunConfig(**{**getattr(ns, "file_settings", {}), **values, **changes})
