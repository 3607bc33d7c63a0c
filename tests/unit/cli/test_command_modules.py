"""The CLI's layout: commands.py is dispatch and exit codes only; each command's help, flags and
handler live in its own module (cli/NAME_cmd.py), and a new command is one such module."""

from pathlib import Path

from ddpkit.cli import commands

CLI = Path(commands.__file__).parent


def test_commands_py_stays_dispatch_and_exit_codes():
    lines = len((CLI / "commands.py").read_text().splitlines())
    assert lines <= 170, f"commands.py has {lines} lines: a command's options, help and handler go in its own module"


def test_each_command_is_declared_in_its_own_module():
    for name, command in commands.COMMANDS.items():
        module = command.run.__module__
        assert module == f"ddpkit.cli.{name}_cmd", (name, module)
        assert (CLI / f"{name}_cmd.py").is_file()
    modules = {p.stem.removesuffix("_cmd") for p in CLI.glob("*_cmd.py")}
    assert modules == set(commands.COMMANDS), "a *_cmd.py module that no command uses, or the reverse"
