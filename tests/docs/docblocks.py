"""The pages' code blocks, the markers that say how each is checked, and the checks.

A page is README.md or docs/*.md. A marker is an HTML comment (invisible on a rendered page)
on the line(s) just above a fence:

- none, on a ```bash block: it runs with `bash -e -o pipefail` in the page's scratch folder
  (`ddpkit`, `python` and `torchrun` are this checkout's), after the page's blocks above it;
  `<!-- expect: REGEX -->` must then match its output;
- `<!-- dry-run -->` (bash): every `ddpkit train|launch|slurm` command gets `--dry-run` (a
  many-node or SLURM command prints its plan and starts nothing), then the block runs;
- `<!-- parse -->` (bash): nothing runs; every command is read by what it calls: `ddpkit ...`
  by ddpkit's own parser (every flag and value accepted; a FILE.py:FUNCTION task defined),
  `make TARGET VAR=...` by the Makefile, `pip install ...[EXTRA]` by pyproject.toml's extras,
  `python FILE.py --flag` / `bash FILE.sh` by that file; anything else fails;
- `<!-- file: NAME -->` (any language): written to NAME in the scratch folder for later blocks
  (a python file must compile);
- `<!-- diff: BEFORE AFTER -->` (diff): exactly the unified diff of two files of the repository;
- `<!-- fragment -->` (python): part of a program: it must compile, and every `ddpkit.NAME`,
  `rt.NAME` and the keywords of their calls (`ddpkit.Task(...)`, `rt.wrap(...)`) must exist;
- `<!-- output -->`: what a command printed; `<!-- figure -->`: a drawing. Neither runs; a
  `$ ddpkit ...` line in them is parsed as above;
- `<!-- layout: DIR -->`: a tree whose first column names files and folders of DIR, and
  which names every module and package of DIR;
- `<!-- needs: COMMAND [--FLAG ...] -->`: the block uses `ddpkit COMMAND` with those flags.
A block that none of these checks fails (`unchecked`). Besides the blocks: every `ddpkit ...`
and `--flag` in a page's inline code must be in the CLI (with a value among the flag's
choices), and every `ddpkit[EXTRA]` an extra of pyproject.toml.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import functools
import io
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
KINDS = ("needs", "expect", "file", "diff", "output", "figure", "parse", "dry-run", "fragment", "layout")
MARKER = re.compile(rf"\s*<!-- ({'|'.join(KINDS)})(?:: (.*?))? -->\s*$")
FENCE = re.compile(r"(\s*)```([\w-]*)\s*$")
DRY_RUN_COMMANDS = ("train", "launch", "slurm")
ENGINE_COMMANDS = ("slurm", "k8s", "sky", "ray")
# shell words a `parse` block may use around the commands it checks
SHELL_WORDS = {"cat", "cd", "cmp", "echo", "grep", "ls", "mkdir", "printf", "sed", "head", "tail"}


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    text: str
    markers: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)} line {self.line}"

    @property
    def id(self) -> str:
        if "file" in self.markers or "diff" in self.markers:
            what = self.markers.get("file") or Path(self.markers["diff"].split()[-1]).name
        else:
            words = [w for w in self.text.split() if "=" not in w and w != "\\"]  # skip VAR=value and line breaks
            what = " ".join(words[:6])[:40]
        return f"{self.page.stem}:L{self.line} {self.lang}: {what}"

    @property
    def kind(self) -> str:
        """How the block is checked; 'unchecked' when nothing checks it."""
        for kind in ("file", "diff", "output", "figure", "parse", "dry-run", "fragment", "layout"):
            if kind in self.markers:
                return kind
        return "run" if self.lang == "bash" else "unchecked"


def parse_page(text: str, page: Path) -> list[Block]:
    lines = text.splitlines()
    blocks, markers, i = [], {}, 0
    while i < len(lines):
        m, f = MARKER.match(lines[i]), FENCE.match(lines[i])
        if m:
            markers[m.group(1)] = m.group(2) or ""
        elif f:
            indent, start, body = f.group(1), i + 1, []
            i += 1
            while not re.match(rf"{indent}```\s*$", lines[i]):
                body.append(lines[i][len(indent) :])
                i += 1
            blocks.append(Block(page, start, f.group(2), "\n".join(body) + "\n", markers))
            markers = {}
        elif lines[i].strip():
            markers = {}  # a marker belongs to the fence right below it
        i += 1
    return blocks


def prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the page outside its fences and HTML comments."""
    out, fenced = [], None
    for n, line in enumerate(text.splitlines(), 1):
        f = FENCE.match(line)
        if f and fenced is None:
            fenced = f.group(1)
        elif fenced is not None and re.match(rf"{fenced}```\s*$", line):
            fenced = None
        elif fenced is None and not line.lstrip().startswith("<!--"):
            out.append((n, line))
    return out


# ---- the CLI, as its parser declares it ----


@functools.lru_cache(maxsize=1)
def cli() -> dict[str, argparse.ArgumentParser]:
    from ddpkit.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return dict(sub.choices)


def options(command: str) -> dict[str, argparse.Action]:
    return {o: a for a in cli()[command]._actions for o in a.option_strings}


@functools.lru_cache(maxsize=1)
def all_options() -> dict[str, list[argparse.Action]]:
    out: dict[str, list[argparse.Action]] = {}
    for command in cli():
        for o, a in options(command).items():
            out.setdefault(o, []).append(a)
    return out


def missing_features(needs: str) -> list[str]:
    """What of `COMMAND --FLAG...` this checkout's CLI lacks (read from its --help)."""
    command, *flags = needs.split()
    if command not in cli():
        return [f"ddpkit {command}"]
    return [f"ddpkit {command} {f}" for f in flags if f not in options(command)]


def ddpkit_problems(argv: list[str], root: Path) -> list[str]:
    """What is wrong with the command line `ddpkit ARGV` (nothing when the CLI takes it as it
    is and its FILE.py:FUNCTION task exists)."""
    from ddpkit.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            ns = build_parser().parse_args(argv)
    except SystemExit as e:
        if e.code in (0, None):  # --help
            return []
        return [f"`ddpkit {shlex.join(argv)}`: {err.getvalue().strip().splitlines()[-1]}"]
    problems = []
    if ns.command in ENGINE_COMMANDS:  # the arguments after -- are `ddpkit train`'s
        problems += ddpkit_problems(["train", *ns.train_args], root)
    if ns.command == "launch" and not ns.module and ns.script.endswith(".py"):
        problems += script_problems(ns.script, list(ns.args), root)
    task = getattr(ns, "task", None)
    if isinstance(task, str):
        problems += task_problems(task, root)
    return problems


def task_problems(task: str, root: Path) -> list[str]:
    from ddpkit.task import BUILTIN_TASKS

    if task in BUILTIN_TASKS:
        return []
    if ":" not in task:
        return [f"task {task!r}: not a built-in task ({', '.join(BUILTIN_TASKS)}) nor MODULE:FUNCTION"]
    where, name = task.rsplit(":", 1)
    if where.endswith(".py"):
        path = root / where
        if not path.is_file():
            return [f"task {task}: no file {where}"]
        if not re.search(rf"^(def {re.escape(name)}\(|{re.escape(name)} = )", path.read_text(), re.M):
            return [f"task {task}: {where} defines no {name}"]
        return []
    import importlib.util

    try:
        found = importlib.util.find_spec(where) is not None
    except ImportError:
        found = False
    return [] if found else [f"task {task}: no module {where}"]


# ---- shell text, read without running it ----


def commands(text: str) -> list[list[str]]:
    """The simple commands of a shell text, as words: continuation lines joined, comments
    dropped, split at | || && ; and without redirections or VAR=value prefixes."""
    out: list[list[str]] = []
    pending = ""
    for line in text.replace("\\\n", " ").splitlines():
        pending += line + "\n"
        try:
            lex = shlex.shlex(pending, posix=True, punctuation_chars=";&|<>")
            lex.whitespace_split, lex.commenters = True, "#"
            tokens = list(lex)
        except ValueError:  # a quote still open: the command goes on on the next line
            continue
        pending = ""
        words: list[str] = []
        skip = False
        for i, tok in enumerate(tokens):
            if skip:
                skip = False
            elif tok in ("|", "||", "&&", ";", "&"):
                out.append(words)
                words = []
            elif set(tok) <= set("<>&"):
                skip = not tok.endswith("&")  # `> FILE` drops FILE; `>&` is followed by a number
                if words and words[-1].isdigit() and i > 0 and tokens[i - 1] == words[-1]:
                    words.pop()  # the 2 of 2>&1
            elif tok.isdigit() and i > 0 and tokens[i - 1] == ">&":
                continue
            elif not words and re.match(r"^\w+=", tok):
                continue  # VAR=value before the command
            else:
                words.append(tok)
        out.append(words)
    return [w for w in out if w]


def command_problems(words: list[str], root: Path, strict: bool) -> list[str]:
    """What is wrong with one command. `strict`: a command nothing here can read is a problem
    (a `parse` block); otherwise only ddpkit's commands inside it are read."""
    head, args = words[0], words[1:]
    if head == "ddpkit":
        return ddpkit_problems(args, root)
    if head in ("python", "python3"):
        return python_problems(args, root, strict)
    if head == "torchrun":
        return torchrun_problems(args, root)
    if head in ("srun", "mpirun", "mpiexec") and "ddpkit" in args:
        return ddpkit_problems(args[args.index("ddpkit") + 1 :], root)
    if head in ("srun", "mpirun", "mpiexec") and ("python" in args or "python3" in args):
        at = next(i for i, a in enumerate(args) if a in ("python", "python3"))
        return python_problems(args[at + 1 :], root, strict)
    if not strict:
        return []
    if head == "make":
        return make_problems(args, root)
    if head in ("pip", "pip3") or words[:3] in (["python", "-m", "pip"], ["python3", "-m", "pip"]):
        return [f"`{shlex.join(words)}`: no extra {e} in pyproject.toml" for e in extras_named(" ".join(args))[1]]
    if head == "bash" and args:
        return script_problems(args[0], args[1:], root)
    if head in SHELL_WORDS:
        return []
    return [f"`{shlex.join(words)}`: nothing checks a `{head}` command: run the block, or mark it otherwise"]


def python_problems(args: list[str], root: Path, strict: bool) -> list[str]:
    if args[:2] == ["-m", "ddpkit"]:
        return ddpkit_problems(args[2:], root)
    if args[:1] == ["-c"] and len(args) > 1:
        try:
            compile(args[1], "<python -c>", "exec")
        except SyntaxError as e:
            return [f"`python -c`: {e}"]
        return []
    if args and args[0].endswith(".py"):
        return script_problems(args[0], args[1:], root)
    return [f"`python {shlex.join(args)}`: cannot check it"] if strict else []


def script_problems(script: str, args: list[str], root: Path) -> list[str]:
    """A script of the repository (or one the page wrote) and the flags it is given."""
    path = root / script
    if not path.is_file():
        return [f"no file {script}"]
    text = path.read_text()
    return [
        f"{script} has no flag {flag}"
        for flag in (a.split("=")[0] for a in args if a.startswith("--"))
        if f'"{flag}"' not in text and f"'{flag}'" not in text and not re.search(rf"^\s*{flag}\)", text, re.M)
    ]


def torchrun_problems(args: list[str], root: Path) -> list[str]:
    """torchrun's flags, read by `ddpkit launch` (which takes every spelling torchrun takes),
    and the ddpkit command it runs."""
    if "-m" in args and args[args.index("-m") + 1 : args.index("-m") + 2] == ["ddpkit"]:
        at = args.index("-m")
        return ddpkit_problems(["launch", *args[:at], "-m", "ddpkit"], root) + ddpkit_problems(args[at + 2 :], root)
    return ddpkit_problems(["launch", *args], root)


@functools.lru_cache(maxsize=1)
def makefile() -> tuple[set[str], set[str]]:
    text = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", text, re.M))
    variables = set(re.findall(r"^(\w+) *\??=", text, re.M))
    return targets, variables


def make_problems(args: list[str], root: Path) -> list[str]:
    targets, variables = makefile()
    problems = []
    target = None
    for a in args:
        if "=" in a:
            name, value = a.split("=", 1)
            if name not in variables:
                problems.append(f"`make {a}`: the Makefile has no variable {name}")
            elif name == "ARGS" and target == "train":
                problems += ddpkit_problems(["train", *shlex.split(value)], root)
        elif a not in targets:
            problems.append(f"`make {a}`: the Makefile has no target {a}")
        else:
            target = a
    return problems


@functools.lru_cache(maxsize=1)
def extras() -> set[str]:
    import tomllib

    return set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def extras_named(text: str) -> tuple[list[str], list[str]]:
    """The extras `ddpkit[a,b]` / `.[a,b]` in a text: (all of them, those pyproject.toml lacks)."""
    named = [e.strip() for group in re.findall(r"(?:ddpkit|\.)\[([\w,-]+)\]", text) for e in group.split(",")]
    return named, [e for e in named if e not in extras()]


def with_dry_run(text: str) -> str:
    """The block with --dry-run added to every ddpkit command that takes it (before a `--`)."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        m = re.search(rf"\bddpkit ({'|'.join(DRY_RUN_COMMANDS)})\b", line)
        if m and "--dry-run" not in line:
            end = len(line.split("  #")[0].rstrip())
            cut = line.find(" -- ", m.end())
            at = cut if cut != -1 else end
            line = line[:at] + " --dry-run" + line[at:]
        out.append(line)
    return "\n".join(out) + "\n"


# ---- python fragments ----


@functools.lru_cache(maxsize=1)
def session_attributes() -> set[str]:
    from ddpkit.ownloop.session import Session

    source = (REPO / "src" / "ddpkit" / "ownloop/session.py").read_text()
    return set(dir(Session)) | set(re.findall(r"self\.(\w+)(?::[^=]*)? = ", source))


def fragment_problems(code: str) -> list[str]:
    """A fragment that does not compile, or uses a ddpkit name, an rt. attribute or a keyword
    that does not exist."""
    import importlib.util
    import inspect

    import ddpkit
    from ddpkit.ownloop.session import Session

    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        return [f"does not compile: {e}"]
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner, name = node.value.id, node.attr
            if owner == "ddpkit" and name not in ddpkit.__all__ and importlib.util.find_spec(f"ddpkit.{name}") is None:
                problems.append(f"ddpkit.{name} does not exist")
            if owner == "rt" and name not in session_attributes():
                problems.append(f"rt.{name}: a Session has no {name}")
        func = node.func if isinstance(node, ast.Call) else None
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner, name = func.value.id, func.attr
            target = None
            if owner == "ddpkit" and name in ddpkit.__all__:
                target = getattr(ddpkit, name)
            elif owner == "rt" and callable(getattr(Session, name, None)):
                target = getattr(Session, name)
            if target is None:
                continue
            params = inspect.signature(target).parameters
            if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                continue
            problems += [
                f"{owner}.{name}({k.arg}=...): no such parameter"
                for k in node.keywords
                if k.arg is not None and k.arg not in params
            ]
    return problems


# ---- inline code ----

INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")


def inline_problems(text: str, root: Path) -> list[str]:
    """The page's inline code that names a ddpkit command or flag that does not exist, a flag
    value outside its choices, or an extra pyproject.toml lacks. A `--flag` that is not
    ddpkit's may be one of a script the same paragraph names (`python benchmarks/run.py`)."""
    problems = []
    scripts: list[Path] = []
    for n, line in prose(text):
        if not line.strip():
            scripts = []  # a new paragraph
        for span in INLINE.findall(line):
            span = span.replace("\\|", "|")
            script = re.search(r"(?:^|\s)([\w/.-]+/[\w.-]+\.(?:py|sh))\b", span)
            if script and (root / script.group(1)).is_file():
                scripts.append(root / script.group(1))
            found = span_problems(span, root)
            flag = span.split()[0].split("=")[0]
            if found and any(_has_flag(s, flag) for s in scripts):
                found = []
            problems += [f"line {n}: `{span}`: {p}" for p in found]
        problems += [f"line {n}: no extra {e} in pyproject.toml" for e in extras_named(line)[1]]
    return problems


def _has_flag(script: Path, flag: str) -> bool:
    text = script.read_text()
    return f'"{flag}"' in text or f"'{flag}'" in text


def span_problems(span: str, root: Path) -> list[str]:
    words = span.split()
    if re.match(r"(ddpkit|rt)\.\w", span) and ("(" in span or span.split()[0].count(".") > 1):
        return python_name_problems(span)  # (ddpkit.world_size alone may be a name of something else: a tag)
    if words[0] in ("python", "python3", "torchrun", "make", "pip") and len(words) > 1:
        if words[0].startswith("python") and "/" not in span:
            return []  # `python script.py`: a name for any script
        one = re.sub(r"([\w.,-]+)(\|[\w.,-]+)+", r"\1", span)  # a|b: the first of the alternatives
        found = [p for cmd in commands(one) for p in command_problems(cmd, root, True)]
        return [p for p in found if not re.fullmatch(r"no file [^/]+", p)]  # torchrun ... script.py: any script
    if words[0] == "ddpkit" and len(words) > 1 and not words[1].startswith("-") and not words[1].isupper():
        command = words[1].split("|")[0]  # ddpkit slurm|k8s: the first of the alternatives
        if command not in cli():
            return [f"no command ddpkit {command}"]
        known = options(command)
        problems = []
        for i, w in enumerate(words[2:], 2):
            if w == "--" and command in ENGINE_COMMANDS:
                command, known = "train", options("train")
            elif w.startswith("--") and len(w) > 2:
                flag = w.split("=")[0]
                if flag not in known:
                    problems.append(f"ddpkit {command} has no {flag}")
                elif i + 1 < len(words):
                    problems += value_problems(known[flag], words[i + 1])
        return problems
    if words[0].startswith("--") and len(words[0]) > 2 and re.match(r"^--[a-z][\w-]*(=\S*)?$", words[0]):
        flag = words[0].split("=")[0]
        actions = all_options().get(flag)
        if not actions:
            return [f"no ddpkit command has {flag}"]
        if len(words) > 1:
            found = [value_problems(a, words[1]) for a in actions]
            return [] if any(not f for f in found) else found[0]
    return []


def python_name_problems(span: str) -> list[str]:
    """`ddpkit.a.b` must resolve (a module, then attributes); `ddpkit.f(k=...)` / `rt.f(k=...)`
    as a fragment (its names and keywords exist)."""
    import importlib

    name = re.match(r"[\w.]+", span).group(0).rstrip(".")
    problems = []
    if name.startswith("ddpkit."):
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
                break
            except ImportError:
                continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return [f"{name}: no {attr} in {'.'.join(parts[:i])}"]
            obj, i = getattr(obj, attr), i + 1
    try:
        ast.parse(span)
    except SyntaxError:
        return problems
    return problems + fragment_problems(span)


def value_problems(action: argparse.Action, value: str) -> list[str]:
    """A written value (`a|b|c`, lower case: not a METAVAR) outside the flag's choices."""
    if not action.choices or not re.fullmatch(r"[a-z0-9][\w.-]*(\|[a-z0-9][\w.-]*)*", value):
        return []
    flag = action.option_strings[0]
    allowed = ", ".join(map(str, action.choices))
    return [f"{flag} {v}: not one of {allowed}" for v in value.split("|") if v not in action.choices]


def layout_names(text: str) -> list[str]:
    """The first column of a layout: the names before the description, on lines that do not
    start with a space (`task.py, tasks/    what the user supplies`)."""
    heads = [re.split(r"\s{2,}", line, maxsplit=1)[0] for line in text.splitlines() if line[:1].strip()]
    return [name.strip() for head in heads for name in head.split(",")]


# ---- running ----


def python_shims(root: Path) -> dict[str, str]:
    """The environment a page's blocks run in: this checkout's ddpkit, python and torchrun
    first on PATH, and the repository's examples/, tests/ and benchmarks/ in the scratch folder."""
    import os

    for name in ("examples", "tests", "benchmarks", "scripts"):
        link = root / name
        if not link.exists():
            link.symlink_to(REPO / name)
    bin_dir = root / ".bin"
    bin_dir.mkdir(exist_ok=True)
    for name, target in (("ddpkit", "-m ddpkit"), ("python", ""), ("torchrun", "-m torch.distributed.run")):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" {target} "$@"\n')
        shim.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(REPO / "src")}


def check_block(block: Block, root: Path, env: dict[str, str]) -> None:
    """Run or read the block as its markers say; an AssertionError says what is wrong."""
    import subprocess

    kind = block.kind
    assert kind != "unchecked", (
        f"{block.where}: a ```{block.lang} block that nothing checks: mark it (tests/docs/docblocks.py says how)"
    )
    if "needs" in block.markers:
        missing = missing_features(block.markers["needs"])
        assert not missing, f"{block.where} uses {', '.join(missing)}, not in ddpkit --help"
    if kind in ("output", "figure"):
        prompts = [line[2:] for line in block.text.splitlines() if line.startswith("$ ")]
        problems = [p for line in prompts for words in commands(line) for p in command_problems(words, root, False)]
        assert not problems, f"{block.where}: " + "; ".join(problems)
        return
    if kind == "file":
        name = block.markers["file"]
        if name.endswith(".py"):
            compile(block.text, name, "exec")
        (root / name).write_text(block.text)
        return
    if kind == "diff":
        before, after = block.markers["diff"].split()
        expected = difflib.unified_diff(
            (REPO / before).read_text().splitlines(keepends=True),
            (REPO / after).read_text().splitlines(keepends=True),
            before,
            after,
        )
        assert block.text == "".join(expected), f"the diff at {block.where} is not the diff of {before} and {after}"
        return
    if kind == "fragment":
        assert block.lang == "python", f"{block.where}: a fragment is python"
        problems = fragment_problems(block.text)
        assert not problems, f"{block.where}: " + "; ".join(problems)
        return
    if kind == "layout":
        base = REPO / block.markers["layout"]
        names = layout_names(block.text)
        missing = [n for n in names if not (base / n).exists()]
        assert names and not missing, f"{block.where}: no {', '.join(missing) or 'names'} in {base.relative_to(REPO)}"
        words = set(re.findall(r"[\w.]+/?", block.text))
        unnamed = [
            p.name + "/" * p.is_dir()
            for p in sorted(base.iterdir())
            if not p.name.startswith("_") and (p.suffix == ".py" or p.is_dir())
            if p.name not in words and p.name + "/" not in words
        ]
        assert not unnamed, f"{block.where}: the layout does not name {', '.join(unnamed)}"
        return
    problems = [p for words in commands(block.text) for p in command_problems(words, root, kind == "parse")]
    assert not problems, f"{block.where}: " + "; ".join(problems)
    if kind == "parse":
        return
    assert block.lang == "bash", f"{block.where}: only bash blocks run"
    script = with_dry_run(block.text) if kind == "dry-run" else block.text
    proc = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{block.where} exited {proc.returncode}:\n{script}\n{output}"
    if "expect" in block.markers:
        expect = block.markers["expect"]
        assert re.search(expect, output), f"{block.where}: no {expect!r} in:\n{output}"
