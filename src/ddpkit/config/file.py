"""Config files (`--config FILE`): a run's settings in TOML, YAML or JSON, checked key by key
into the values the flags would give, so that the file, the flags and the Python API all end
in the same RunConfig. A run's own config.json is such a file: it replays the run."""

from __future__ import annotations

import dataclasses
import difflib
import json
from pathlib import Path
from typing import Any

from ..errors import DdpkitError
from . import NODES, RunConfig, flag_spellings
from .launch import TABLE as LAUNCH
from .launch import LaunchTable, launch_table
from .values import parse_task_arg

FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}

# Keys a run's config.json holds that are no setting of a run: accepted in any config file and
# ignored. `resume` says how one command started (--resume), not what the run is: ignoring it
# lets a resumed run's config.json replay the whole run into a new --run-dir.
RECORD_ONLY = frozenset({"resume"})

FORMATS = {".toml": "TOML", ".yaml": "YAML", ".yml": "YAML", ".json": "JSON"}
_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def table_name(group: str) -> str:
    """A group's table in a file: the first word of its --help-all title (`[faults]` for "faults and signals")."""
    return "nodes" if group == NODES else group.split()[0].lower()


TABLES = {table_name(f.metadata["group"]): f.metadata["group"] for f in FIELDS.values() if f.metadata["group"]}


def _spellings() -> dict[str, tuple[str, bool]]:
    """Every key that names a setting: the field's name and its flags' long spellings, with
    `-` or `_`; True where the key means the opposite (`no-shuffle = true` is shuffle false)."""
    out: dict[str, tuple[str, bool]] = {}
    for name, f in FIELDS.items():
        flags = flag_spellings(f)
        inverted = bool(f.metadata.get("flag")) and f.default is True  # a store_false flag: --no-shuffle
        out[name] = out[name.replace("_", "-")] = (name, False)
        for flag in flags:
            if flag.startswith("--"):
                for key in (flag[2:], flag[2:].replace("-", "_"), flag[2:].replace("_", "-")):
                    out.setdefault(key, (name, inverted))
    return out


SPELLINGS = _spellings()


def load_config(path: str | Path, **overrides: Any) -> RunConfig:
    """The RunConfig of a config file, with `overrides` on top (the Python side of --config)."""
    return RunConfig(**{**read_config_file(path), **overrides})


def read_config_file(path: str | Path) -> dict[str, Any]:
    """{field name: value} of every setting the file gives, each checked and converted as its
    flag's text would be. A user's mistake is a DdpkitError naming the file and the key."""
    return settings_of(_read(Path(path)), str(path))


def _read(p: Path) -> dict[str, Any]:
    """The parsed table of a config file (its format from its name)."""
    path = str(p)
    kind = FORMATS.get(p.suffix.lower())
    if kind is None:
        raise DdpkitError(f"--config {path}: name the file .toml, .yaml, .yml or .json (its format)")
    try:
        text = p.read_text()
    except OSError as e:
        raise DdpkitError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    data = _parse(text, kind, p)
    if not isinstance(data, dict):
        raise DdpkitError(f"{path}: a config file holds a table of settings (KEY = VALUE), not {type(data).__name__}")
    return data


def read_launch_table(path: str | Path) -> LaunchTable:
    """The file's [launch] table (the job: nodes, GPUs, time, where it runs), checked; an empty
    table where the file has none."""
    p = Path(path)
    return launch_table(_read(p).get(LAUNCH), str(path))


def _parse(text: str, kind: str, path: Path) -> Any:
    if kind == "JSON":
        loads, errors = json.loads, (ValueError,)
    elif kind == "TOML":
        toml = _toml()
        loads, errors = toml.loads, (toml.TOMLDecodeError,)
    else:
        try:
            import yaml
        except ImportError:
            raise DdpkitError(
                f"--config {path}: reading YAML needs PyYAML: pip install 'ddpkit[yaml]' (or use a .toml or .json file)"
            ) from None
        loads, errors = yaml.safe_load, (yaml.YAMLError,)
    try:
        return loads(text)
    except errors as e:
        raise DdpkitError(f"{path}: not valid {kind}: {_syntax_error(e)}") from None


def _syntax_error(e: Exception) -> str:
    """A parser's complaint in one line, with the line it points at: JSON and TOML say it in
    their first line; PyYAML says it in a "mark" after the problem."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is not None and problem:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _toml() -> Any:
    try:
        import tomllib  # Python 3.11+
    except ModuleNotFoundError:
        try:
            import tomli as tomllib  # the same parser for 3.10, a dependency there
        except ModuleNotFoundError:
            raise DdpkitError(
                "reading TOML on Python 3.10 needs tomli: pip install tomli (or use a .json or .yaml file)"
            ) from None
    return tomllib


def settings_of(data: dict[str, Any], where: str) -> dict[str, Any]:
    """The settings of a parsed file: top-level keys, or keys inside a group's table
    (`[training]`); a key is a field's name or its flag's spelling."""
    found: dict[str, tuple[str, Any]] = {}
    unknown: list[str] = []
    for key, value in data.items():
        key = str(key)
        if key == LAUNCH:
            launch_table(value, where)  # the engines' table: checked here, read by read_launch_table
            continue
        spelled = SPELLINGS.get(key)
        if isinstance(value, dict) and key in TABLES and not (spelled and _is_table(FIELDS[spelled[0]])):
            for inner, v in value.items():
                _take(found, unknown, str(inner), v, where, table=key)
        else:
            _take(found, unknown, key, value, where)
    if unknown:
        raise DdpkitError(f"{where}: " + "; ".join(unknown) + " (the keys are the settings of `ddpkit train --help`)")
    return {name: _convert(FIELDS[name], key, value, where) for name, (key, value) in found.items()}


def _take(
    found: dict[str, tuple[str, Any]], unknown: list[str], key: str, value: Any, where: str, table: str = ""
) -> None:
    shown = f"{table}.{key}" if table else key
    if key in RECORD_ONLY:
        return
    spelled = SPELLINGS.get(key)
    if spelled is None:
        candidates = [k for k in SPELLINGS if k not in RECORD_ONLY] + ([] if table else [*TABLES, LAUNCH])
        near = difflib.get_close_matches(key, candidates, n=1)
        unknown.append(f"unknown setting {shown!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
        return
    name, inverted = spelled
    group = FIELDS[name].metadata["group"]
    if table and TABLES[table] != group:
        raise DdpkitError(f"{where}: {shown}: {key} is a setting of [{table_name(group)}], not of [{table}]")
    if name in found:
        raise DdpkitError(f"{where}: {found[name][0]!r} and {shown!r} both set {name}: keep one")
    if inverted:
        if not isinstance(value, bool):
            raise DdpkitError(f"{where}: {shown} must be true or false, got {value!r}")
        value = not value
    found[name] = (shown, value)


def _convert(f: dataclasses.Field, key: str, value: Any, where: str) -> Any:
    """The value as RunConfig takes it: text is parsed as the flag's text would be; numbers
    and booleans must be of the setting's type; choices are checked here, naming the file."""
    meta, annotation = f.metadata, str(f.type)
    base = _TYPES.get(annotation.split("|")[0].strip())

    def bad(expected: str) -> DdpkitError:
        return DdpkitError(f"{where}: {key} must be {expected}, got {value!r}")

    if value is None:
        if "None" in annotation:
            return None
        raise bad("a value (it has no 'unset')")
    if is_list(f):
        return _list(f, key, value, where)
    if _is_table(f):
        if isinstance(value, list) and meta.get("append") and all(isinstance(v, str) for v in value):
            return dict(_parsed(parse_task_arg, v, key, where) for v in value)  # ["hidden=64"], as the flags
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise bad("a table of KEY = VALUE")
        return dict(value)
    if base is bool or isinstance(value, bool):
        if base is not bool or not isinstance(value, bool):
            raise bad("true or false" if base is bool else f"{_noun(base)}, not true/false")
        return value
    if isinstance(value, str) and base is not str:
        value = _parsed(meta.get("type") or base, value, key, where)  # "1e-3", "auto": as on the command line
    elif base is float and isinstance(value, int):
        value = float(value)
    elif base is str and isinstance(value, int):
        value = str(value)  # nnodes = 2, redirects = 3
    elif base is not None and not isinstance(value, base) and not (meta.get("type") is str and isinstance(value, int)):
        raise bad(_noun(base))
    if meta.get("choices") and value not in meta["choices"]:
        raise bad("one of " + ", ".join(meta["choices"]))
    return value


def _is_table(f: dataclasses.Field) -> bool:
    """A setting whose value is a table of its own (task_args, extra), not a group's table."""
    return f.default_factory is not dataclasses.MISSING and isinstance(f.default_factory(), dict)


def is_list(f: dataclasses.Field) -> bool:
    """A setting whose value is a list (--tracker, a repeatable flag of single values)."""
    return f.default_factory is not dataclasses.MISSING and isinstance(f.default_factory(), list)


def _list(f: dataclasses.Field, key: str, value: Any, where: str) -> list[Any]:
    """A list-valued setting: one value (`tracker = "csv"`) or a list of them, each read as
    one repetition of its flag would be."""
    choices = f.metadata.get("choices")
    expected = ("one of " + ", ".join(choices) if choices else "a value") + " (or a list of them)"
    out = []
    for item in value if isinstance(value, list) else [value]:
        if not isinstance(item, str) or (choices and item not in choices):
            raise DdpkitError(f"{where}: {key} must be {expected}, got {item!r}")
        out.append(_parsed(f.metadata["type"], item, key, where) if f.metadata.get("type") else item)
    return out


def _parsed(parse: Any, text: str, key: str, where: str) -> Any:
    try:
        return parse(text)
    except ValueError as e:
        said = f"must be {_noun(parse)}, got {text!r}" if parse in (int, float) else str(e)
        raise DdpkitError(f"{where}: {key} {said}") from None


def _noun(base: type | None) -> str:
    return {int: "an integer", float: "a number", str: "text"}.get(base, "a value")
