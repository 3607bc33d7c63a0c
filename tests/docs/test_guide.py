"""docs/guide.md cannot rot: its blocks are executed, in order, in one scratch folder.

How the guide is read (the markers are HTML comments on the line(s) just above a fence):
- a ```bash block runs with `bash -e -o pipefail` (`ddpkit`, `python` and `torchrun` are this
  checkout's); `<!-- expect: REGEX -->` must then match its output;
- `<!-- needs: COMMAND [--FLAG ...] -->`: the block uses `ddpkit COMMAND` (with those flags);
  when `ddpkit --help` lacks one, the block fails naming it (a guide must not describe a
  command that is gone);
- `<!-- file: NAME -->` above a ```python block writes it to NAME for later blocks;
- `<!-- diff: BEFORE AFTER -->` above a ```diff block: it must be exactly the unified diff
  of those two files of the repository.
Commands run as written: the guide's epoch counts are small enough. Blocks depend on the
ones before them (runs/ fills up), so select them with -k only together with those.
"""

from __future__ import annotations

import difflib
import os
import re
import runpy
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import REPO

GUIDE = REPO / "docs" / "guide.md"
MARKER = re.compile(r"\s*<!-- (needs|expect|file|diff): (.*?) -->\s*$")
FENCE = re.compile(r"(\s*)```(\w*)\s*$")


@dataclass
class Block:
    line: int
    lang: str
    text: str
    markers: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        if "file" in self.markers or "diff" in self.markers:
            what = self.markers.get("file") or Path(self.markers["diff"].split()[-1]).name
        else:
            words = [w for w in self.text.split() if "=" not in w and w != "\\"]  # skip VAR=value and line breaks
            what = " ".join(words[:6])[:40]
        return f"L{self.line} {self.lang}: {what}"


def parse_guide(text: str) -> list[Block]:
    lines = text.splitlines()
    blocks, markers, i = [], {}, 0
    while i < len(lines):
        m, f = MARKER.match(lines[i]), FENCE.match(lines[i])
        if m:
            markers[m.group(1)] = m.group(2)
        elif f:
            indent, start, body = f.group(1), i + 1, []
            i += 1
            while not re.match(rf"{indent}```\s*$", lines[i]):
                body.append(lines[i][len(indent) :])
                i += 1
            blocks.append(Block(start, f.group(2), "\n".join(body) + "\n", markers))
            markers = {}
        elif lines[i].strip():
            markers = {}  # a marker belongs to the fence right below it
        i += 1
    return blocks


BLOCKS = [b for b in parse_guide(GUIDE.read_text()) if b.lang in ("bash", "python", "diff")]


def missing_features(needs: str) -> list[str]:
    """What of `COMMAND --FLAG...` this checkout's CLI lacks (read from its --help)."""
    from ddpkit.cli import build_parser

    command, *flags = needs.split()
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    if command not in sub.choices:
        return [f"ddpkit {command}"]
    options = {o for a in sub.choices[command]._actions for o in a.option_strings}
    return [f"ddpkit {command} {f}" for f in flags if f not in options]


@pytest.fixture(scope="module")
def guide_dir(tmp_path_factory):
    """The scratch folder every block runs in, with the repository's examples/ and this
    checkout's ddpkit, python and torchrun first on PATH."""
    root = tmp_path_factory.mktemp("guide")
    (root / "examples").symlink_to(REPO / "examples")
    bin_dir = root / ".bin"
    bin_dir.mkdir()
    for name, target in (("ddpkit", "-m ddpkit"), ("python", ""), ("torchrun", "-m torch.distributed.run")):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" {target} "$@"\n')
        shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(REPO / "src")}
    return root, env


def test_a_command_or_flag_the_cli_lacks_is_named():
    assert missing_features("check") == []
    assert missing_features("train --nproc --resume") == []
    assert missing_features("train --nproc --no-such-flag") == ["ddpkit train --no-such-flag"]
    assert missing_features("no-such-command --x") == ["ddpkit no-such-command"]


def test_every_code_block_of_the_guide_is_checked():
    """No ```python or ```diff block that nothing runs or compares; at least the path's commands."""
    for b in BLOCKS:
        if b.lang == "python":
            assert "file" in b.markers, (
                f"guide line {b.line}: a python block needs <!-- file: NAME --> and a command that runs it"
            )
        if b.lang == "diff":
            assert "diff" in b.markers, f"guide line {b.line}: a diff block needs <!-- diff: BEFORE AFTER -->"
    commands = "".join(b.text for b in BLOCKS if b.lang == "bash")
    for needed in (
        "ddpkit env",
        "ddpkit train --nproc 1",
        "ddpkit train --nproc 2",
        "ddpkit plot",
        "--resume",
        "ddpkit launch",
        "torchrun",
        "ddpkit plan",
        "--strategy fsdp",
        "ddpkit slurm",
    ):
        assert needed in commands, needed


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_guide_block(block, guide_dir):
    root, env = guide_dir
    if "needs" in block.markers:
        missing = missing_features(block.markers["needs"])
        assert not missing, f"the guide's block at line {block.line} uses {', '.join(missing)}, not in ddpkit --help"
    if "file" in block.markers:
        (root / block.markers["file"]).write_text(block.text)
        return
    if "diff" in block.markers:
        before, after = block.markers["diff"].split()
        expected = difflib.unified_diff(
            (REPO / before).read_text().splitlines(keepends=True),
            (REPO / after).read_text().splitlines(keepends=True),
            before,
            after,
        )
        assert block.text == "".join(expected), (
            f"the diff at guide line {block.line} is not the diff of {before} and {after}"
        )
        return
    assert block.lang == "bash"
    proc = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", block.text],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"guide line {block.line} exited {proc.returncode}:\n{block.text}\n{output}"
    if "expect" in block.markers:
        assert re.search(block.markers["expect"], output), (
            f"guide line {block.line}: no {block.markers['expect']!r} in:\n{output}"
        )


def test_the_script_before_conversion_runs_as_the_guide_says(tmp_path, monkeypatch, capsys):
    """examples/convert/train_single.py is only shown in the guide (as the diff's left side)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train_single.py", "3", "2"])
    runpy.run_path(str(REPO / "examples" / "convert" / "train_single.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "Epoch 2, Loss:" in out
    assert sorted(p.name for p in tmp_path.glob("model_*.pt")) == [
        "model_0.pt",
        "model_2.pt",
    ]  # its habit: one at epoch 0
