"""Flags made from RunConfig's fields: a flag's help, choices and default are written once,
in config.py. Each command takes the groups (or single fields) it needs."""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Callable, Iterable

from ..config import RunConfig
from ..environments.kubeflow import launcher_defaults

_FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}


def add_config_flags(parser: argparse.ArgumentParser, groups: Iterable[str] = (), names: Iterable[str] = (),
                     defaults: dict[str, Any] | None = None) -> None:
    """Add the flags of every RunConfig field in `groups` and of the fields `names`, under
    their group's title; `defaults` overrides a field's default for this command."""
    wanted_groups, wanted_names = set(groups), set(names)
    titles: dict[str, Any] = {}
    # Kubeflow's PET_* variables are torchrun's flags (torchrun reads PET_<FLAG> as each default): so do we
    defaults = {**launcher_defaults(os.environ), **(defaults or {})}
    for f in dataclasses.fields(RunConfig):
        meta = f.metadata
        if not meta.get("cli", True) or not (f.name in wanted_names or meta.get("group") in wanted_groups):
            continue
        default = (defaults or {}).get(f.name, None if meta.get("append") else f.default)
        if meta.get("positional"):
            parser.add_argument(f.name, nargs="?", default=default, help=meta["help"])
            continue
        group = titles.get(meta["group"])
        if group is None:
            group = titles[meta["group"]] = parser.add_argument_group(meta["group"])
        group.add_argument(*flag_names(f.name), **_argparse_kwargs(f, default))


def flag_names(name: str) -> tuple[str, ...]:
    meta = _FIELDS[name].metadata
    return (meta.get("flag") or "--" + name.replace("_", "-"), *meta.get("aliases", ()))


def _argparse_kwargs(f: dataclasses.Field, default: Any) -> dict[str, Any]:
    meta = f.metadata
    kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": meta["help"] + _default_text(meta, default)}
    if isinstance(default, bool):
        kwargs["action"] = "store_false" if default else "store_true"
        return kwargs
    kind = meta.get("type") or (type(f.default) if f.default not in (None, dataclasses.MISSING) else type(default))
    kwargs["type"] = _argparse_type(kind) if kind not in (int, float, str) else kind
    if meta.get("append"):
        kwargs["action"] = "append"  # (key, value) pairs; RunConfig makes them a dict
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


def config_from(ns: argparse.Namespace, **changes: Any) -> RunConfig:
    """The RunConfig of the flags a command parsed (fields it has no flag for keep their default)."""
    values = {name: getattr(ns, name) for name in _FIELDS if hasattr(ns, name)}
    values = {k: v for k, v in values.items() if not (v is None and _FIELDS[k].metadata.get("append"))}
    return RunConfig(**{**values, **changes})
