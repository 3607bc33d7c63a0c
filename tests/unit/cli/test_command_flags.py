"""Every flag of every command is generated: from a RunConfig setting the command takes, or
from its own options dataclass (in its module, cli/NAME_cmd.py), with the help, choices and default written
there once. A hand-written flag would fail here."""

import argparse
import dataclasses

import pytest

from ddpkit import RunConfig
from ddpkit.cli.commands import COMMANDS, build_parser
from ddpkit.cli.flags import flag_names, names_of, opposite
from ddpkit.cli.help import HelpAll
from ddpkit.cli.launch_cmd import LaunchOptions, agent_options

# the least each command needs to parse
MINIMAL = {"launch": ["script.py"], "plot": ["run1"], "export": ["run1"]}


def _subparsers():
    return next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices


def _declared(command):
    """The fields a command's flags come from: RunConfig's it takes, then its own options."""
    taken = [
        f
        for f in dataclasses.fields(RunConfig)
        if f.metadata.get("cli", True) and (f.name in command.names or f.metadata["group"] in command.groups)
    ]
    return {f.name: f for f in taken}, {
        f.name: f for f in (dataclasses.fields(command.options) if command.options else ())
    }


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_flag_is_a_declared_setting_with_its_spellings_and_help(name):
    config_fields, own = _declared(COMMANDS[name])
    assert not set(config_fields) & set(own), "an option of the command shadows a RunConfig setting"
    actions = [a for a in _subparsers()[name]._actions if not isinstance(a, (argparse._HelpAction, HelpAll))]
    assert {a.dest for a in actions} == set(config_fields) | set(own)  # nothing undeclared, nothing left out
    for action in actions:
        f = config_fields.get(action.dest) or own[action.dest]
        assert f.metadata["help"] and f.metadata["help"] in action.help, (name, action.dest)
        assert tuple(action.choices or ()) == tuple(f.metadata.get("choices") or ()), (name, action.dest)
        if action.option_strings:
            spellings = list(flag_names(f.name) if action.dest in config_fields else names_of(f))
            if action.dest in config_fields and isinstance(f.default, bool):  # a setting's switch: and its opposite
                spellings.append(opposite(spellings[0]))
            assert list(action.option_strings) == spellings, (name, action.dest)
        else:
            assert f.metadata["positional"], (name, action.dest)


@pytest.mark.parametrize("name", [n for n, c in COMMANDS.items() if c.options is not None])
def test_left_out_each_option_is_its_declared_default(name):
    ns = build_parser().parse_args([name, *MINIMAL.get(name, [])])
    for f in dataclasses.fields(COMMANDS[name].options):
        if f.metadata["positional"] and f.metadata["nargs"] not in ("?", "*"):
            continue  # given above, or argparse's empty remainder
        assert getattr(ns, f.name) == f.default, (name, f.name)


def test_the_slurm_bench_and_plot_flags_parse_to_their_types():
    ns = build_parser().parse_args(
        [
            "slurm",
            "--nodes",
            "2",
            "--gpus-per-node",
            "8",
            "--wait-timeout",
            "1.5",
            "--signal",
            "",
            "--submit",
            "--",
            "wine",
            "--epochs",
            "3",
        ]
    )
    assert (ns.nodes, ns.gpus_per_node, ns.wait_timeout, ns.signal, ns.submit) == (2, 8, 1.5, "", True)
    assert ns.train_args == ["wine", "--epochs", "3"]
    ns = build_parser().parse_args(["bench", "digits", "--nproc", "1,4", "--iters", "7", "--json", "out.json"])
    assert (ns.task, ns.nproc, ns.iters, ns.steps, ns.json, ns.batch_size) == ("digits", "1,4", 7, 20, "out.json", 32)
    ns = build_parser().parse_args(["plot", "a", "b", "-o", "c.png", "--label", "one", "--label", "two"])
    assert (ns.run_dirs, ns.out, ns.label, ns.title) == (["a", "b"], "c.png", ["one", "two"], None)


def test_agent_options_are_the_torchrun_agent_group():
    assert agent_options() == (
        "role",
        "event_log_handler",
        "signals_to_handle",
        "duplicate_stdout_filters",
        "duplicate_stderr_filters",
        "virtual_local_rank",
        "shutdown_timeout",
        "numa_binding",
        "logs_specs",
    )
    assert all(f.name in agent_options() or f.metadata["group"] == "" for f in dataclasses.fields(LaunchOptions))


def test_the_help_and_the_package_description_say_what_ddpkit_does_today():
    from pathlib import Path

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the same parser, a dependency there
        import tomli as tomllib

    described = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())["project"]["description"]
    for text in (build_parser().description, described):
        assert "HSDP" in text and "coming" not in text, text
