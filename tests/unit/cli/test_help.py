"""`ddpkit train --help` is read, not scrolled: one line per flag in the groups a person looks
in (each setting's from its config section, so a new setting lands in one by itself), at most
150 lines; `--help-all` and `ddpkit help train` hold every flag with its long text."""

import argparse
import dataclasses
import re

import pytest

from ddpkit.cli import build_parser, main
from ddpkit.cli.help import help_group, short_help
from ddpkit.config import FAULTS, NODES, OUTPUT, PERFORMANCE, PROCESSES, STRATEGY, TRAINING, RunConfig

WIDTH = 100


def _printed(capsys, argv):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's --help
        code = e.code
    assert code in (0, None)
    return capsys.readouterr().out


def _parser(name):
    return next(a for a in build_parser()._actions if a.dest == "command").choices[name]


def _head(line):
    """The flag (its long spelling) or argument a line of a one-line help is about."""
    words = re.split(r"\s{2,}", line.strip())[0].replace(",", "").split()
    return next((w for w in words if w.startswith("--")), words[0])


def _groups(text):
    """{group title: [the flag or argument each of its lines starts with]} of a one-line help."""
    out, title = {}, None
    for line in text.splitlines():
        if re.fullmatch(r"\S.*:", line):
            title = line[:-1]
            out[title] = []
        elif title and line.startswith("  "):
            out[title].append(_head(line))
    return out


@pytest.mark.parametrize(
    "name, lines, all_lines", [("train", 150, 300), ("check", 150, 300), ("verify", 150, 300), ("launch", 70, 120),
                               ("plan", 45, 70)]
)  # fmt: skip
def test_help_is_one_line_per_flag_and_help_all_has_every_long_text(name, lines, all_lines, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    short = _printed(capsys, [name, "--help"])
    full = _printed(capsys, [name, "--help-all"])
    assert len(short.splitlines()) <= lines and len(full.splitlines()) > all_lines
    assert _printed(capsys, ["help", name]) == full
    flags = [line for line in short.splitlines() if line.startswith("  ")]
    assert max(len(line) for line in flags) <= WIDTH, max(flags, key=len)
    firsts = [_head(line) for line in flags]
    parser = _parser(name)
    formatter = parser._get_formatter()
    normal = "".join(full.split())  # argparse wraps at spaces and after hyphens
    for action in parser._actions:
        listed = [f for f in firsts if f in (*action.option_strings, action.metavar or action.dest.upper())]
        assert len(listed) == 1, (action.dest, listed)  # on exactly one line
        for option in action.option_strings:  # every spelling, the long text and the default
            assert re.search(rf"(^|[\s,]){re.escape(option)}\b", full, re.M), option
        if action.help and action.help != argparse.SUPPRESS:
            assert "".join(formatter._expand_help(action).split()) in normal, action.dest


def test_the_groups_come_from_the_config_sections(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    groups = _groups(_printed(capsys, ["train", "--help"]))
    assert list(groups) == [
        "options",
        "the task and data",
        "processes and nodes",
        "strategy and mesh",
        "checkpoints and resume",
        "faults",
        "speed",
        "output and trackers",
    ]
    where = {flag: title for title, flags in groups.items() for flag in flags}
    assert where["TASK"] == where["--global-batch-size"] == "the task and data"
    assert where["--nproc"] == where["--nnodes"] == "processes and nodes"
    assert where["--save-every"] == where["--auto-resume"] == where["--keep-best"] == "checkpoints and resume"
    assert where["--hang-timeout"] == where["--max-restarts"] == where["--on-nan"] == "faults"
    assert where["--compile"] == "speed" and where["--tracker"] == "output and trackers"
    sections = {
        TRAINING: "the task and data",
        PROCESSES: "processes and nodes",
        NODES: "processes and nodes",
        STRATEGY: "strategy and mesh",
        FAULTS: "checkpoints and resume",
        PERFORMANCE: "speed",
        OUTPUT: "output and trackers",
    }
    train = {a.dest: a for a in _parser("train")._actions}
    for f in dataclasses.fields(RunConfig):  # every setting (--tp, --pp ... as they come) under its section's group
        if f.metadata.get("cli", True):
            a = train[f.name]
            flag = ([s for s in a.option_strings if s.startswith("--")] or [a.metavar or a.dest.upper()])[0]
            assert where[flag] == (f.metadata["help_group"] or sections[f.metadata["group"]]), f.name
    assert help_group({"group": "storage"}) == "storage"  # a section the table does not name: a group of its own


def test_a_short_help_is_its_gist_cut_at_a_word():
    text = "on one of these signals (e.g. USR1,TERM) save a checkpoint at the next step boundary and stop"
    assert short_help(text, 80) == "on one of these signals save a checkpoint at the next step boundary and stop"
    assert short_help(text, 40) == "on one of these signals save a..."
    assert short_help("bf16: autocast (DDP) or bf16 compute; fp16: a scaler", 80) == "bf16: autocast or bf16 compute"


def test_help_of_a_command_that_is_not_one_is_one_line(capsys):
    assert main(["help", "trian"]) == 2
    assert capsys.readouterr().err.startswith("ddpkit: error: no command 'trian': the commands are train, plan,")
