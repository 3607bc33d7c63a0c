"""The CLI's flags are made from RunConfig's fields: every field a command takes has one flag
with the field's default and choices, and what the flags parse to is a RunConfig."""

import dataclasses

import pytest

from ddpkit import DdpkitError, RunConfig, config
from ddpkit.cli import build_parser
from ddpkit.cli.flags import config_from, flag_names

CLI_FIELDS = [f for f in dataclasses.fields(RunConfig) if f.metadata.get("cli", True)]


def _train_actions():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {a.dest: a for a in sub.choices["train"]._actions}


def test_every_config_field_is_a_train_flag_with_its_default_and_choices():
    actions = _train_actions()
    for f in CLI_FIELDS:
        action = actions[f.name]
        if f.metadata.get("append"):  # repeated flags: nothing given is None, RunConfig's default {} (or [])
            assert action.default is None and f.default_factory() in ({}, []), f.name
        else:
            assert action.default == f.default, f.name
        assert tuple(action.choices or ()) == tuple(f.metadata.get("choices") or ()), f.name
        if not f.metadata.get("positional"):
            opposite = [_opposite(flag_names(f.name)[0])] if isinstance(f.default, bool) else []
            assert list(action.option_strings) == [*flag_names(f.name), *opposite], f.name
        assert f.metadata["help"] and f.metadata["help"] in action.help, f.name


def test_defaults_parse_to_the_default_config():
    ns = build_parser().parse_args(["train"])
    assert config_from(ns) == RunConfig()


def test_flags_reach_the_config():
    ns = build_parser().parse_args(
        [
            "train",
            "digits",
            "--nproc",
            "3",
            "--no-shuffle",
            "--epochs",
            "7",
            "--lr",
            "0.5",
            "--grad-sync",
            "backend",
            "--device-memory",
            "2GiB",
            "--nproc-per-node",
            "4",
        ]
    )
    cfg = config_from(ns)
    assert (cfg.task, cfg.nproc, cfg.shuffle, cfg.epochs, cfg.lr, cfg.grad_sync) == (
        "digits",
        4,
        False,
        7,
        0.5,
        "backend",
    )
    assert cfg.device_memory == 2 * 2**30


def test_task_args_are_repeated_key_value_pairs_of_python_literals():
    ns = build_parser().parse_args(
        [
            "train",
            "x.py:build",
            "--task-arg",
            "n_layer=4",
            "--task-arg",
            "lr=3e-4",
            "--task-arg",
            "name=tiny",
            "--task-arg",
            "flags=[1, 2]",
            "--task-arg",
            "on=True",
        ]
    )
    assert config_from(ns).task_args == {"n_layer": 4, "lr": 3e-4, "name": "tiny", "flags": [1, 2], "on": True}


def test_the_help_names_each_default_once():
    help_text = {a.dest: a.help for a in _train_actions().values()}
    assert help_text["epochs"].endswith("(default 100)")
    assert help_text["timeout"].endswith(f"(default {config.DEFAULT_TIMEOUT_S:g})")
    assert "default auto: one per GPU" in help_text["nproc"]
    assert help_text["epochs"].count("default") == 1


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["train", "--nproc", "0"], "must be a positive integer or 'auto', got '0'"),
        (["train", "--grad-sync", "nope"], "invalid choice: 'nope'"),
        (["train", "--epochs", "many"], "invalid int value: 'many'"),
        (["train", "--task-arg", "n layer=4"], "must be KEY=VALUE with KEY a Python name"),
        (["train", "--lr-schedule", "step"], "invalid choice: 'step'"),
    ],
)
def test_bad_flags_exit_2_with_the_reason(argv, fragment, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    assert fragment in capsys.readouterr().err


def test_plan_takes_the_strategy_flags_with_auto_as_its_default():
    ns = build_parser().parse_args(["plan", "examples/deep_mlp.py:large", "--nproc", "8"])
    assert (ns.strategy, ns.nproc, ns.precision, ns.device_memory) == ("auto", 8, "fp32", None)


def test_launch_takes_the_process_and_node_flags_only():
    ns = build_parser().parse_args(["launch", "--nproc", "2", "--max-restarts", "1", "script.py", "--epochs", "3"])
    cfg = config_from(ns)
    assert (cfg.nproc, cfg.max_restarts) == (2, 1) and ns.args == ["--epochs", "3"]
    assert not hasattr(ns, "epochs")  # the script's own flag, not ours


def _booleans():
    """Every boolean setting that has a flag: a new one is covered by the tests below."""
    return [f for f in CLI_FIELDS if isinstance(f.default, bool)]


def _opposite(flag: str) -> str:
    return "--" + flag[5:] if flag.startswith("--no-") else "--no-" + flag[2:]


@pytest.mark.parametrize("field", _booleans(), ids=lambda f: f.name)
def test_every_boolean_flag_over_a_file_keeps_its_meaning_and_has_an_opposite(tmp_path, field):
    from ddpkit.cli.commands import parse_args

    flag = flag_names(field.name)[0]  # --csv, or --no-shuffle for a setting that is on by default
    on = not field.default  # what the flag sets
    key = flag[2:]  # the flag's spelling as a file's key: `no-shuffle = true` is shuffle false
    for given in (on, not on):
        path = tmp_path / f"{given}.toml"
        path.write_text(f"{key} = {str(given == on).lower()}\nrun-dir = 'r'\n")

        def cfg(*flags, path=path):
            return getattr(config_from(parse_args(["train", "--config", str(path), *flags])), field.name)

        if field.name != "resume":  # `resume` in a file is ignored: how one command started (RECORD_ONLY)
            assert cfg() is given, f"{path.read_text()} alone"
        assert cfg(flag) is on, f"{path.read_text()} + {flag}"
        assert cfg(_opposite(flag)) is (not on), f"{path.read_text()} + {_opposite(flag)}"
        assert cfg(flag, flag) is on and cfg(flag, _opposite(flag)) is (not on)  # the last one given wins


def test_the_opposites_are_made_for_every_command_that_takes_the_setting():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name, parser in sub.choices.items():
        for action in parser._actions:
            if action.dest in {f.name for f in _booleans()}:
                main = flag_names(action.dest)[0]
                assert list(action.option_strings) == [main, _opposite(main)], (name, action.dest)
    assert config_from(build_parser().parse_args(["launch", "--no-verbose", "x.py"])).verbose is False


@pytest.mark.parametrize(
    "file, flags, expected",
    [
        ("quiet = true", ["--verbose"], (False, True)),  # the command line wins over the file
        ("verbose = true", ["--quiet"], (True, False)),
        ("quiet = true", ["--verbose", "--no-quiet"], (False, True)),
        ("quiet = true", [], (True, False)),
    ],
)
def test_a_flag_given_wins_over_a_files_contradicting_setting(tmp_path, file, flags, expected):
    from ddpkit.cli.commands import parse_args

    path = tmp_path / "a.toml"
    path.write_text(file + "\n")
    cfg = config_from(parse_args(["train", "--config", str(path), *flags]))
    assert (cfg.quiet, cfg.verbose) == expected


@pytest.mark.parametrize("file, flags", [("", ["--quiet", "--verbose"]), ("quiet = true\nverbose = true", [])])
def test_contradicting_settings_from_one_place_are_refused_in_one_line(tmp_path, capsys, file, flags):
    from ddpkit.cli import main

    path = tmp_path / "a.toml"
    path.write_text(file + "\n")
    assert main(["train", "--config", str(path), "--dry-run", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--quiet and --verbose contradict each other" in err
    with pytest.raises(DdpkitError, match="--quiet and --verbose contradict each other"):
        RunConfig(quiet=True, verbose=True)
    launch = tmp_path / "b.toml"  # launch takes --verbose but not --quiet: the file's quiet still counts
    launch.write_text("quiet = true\n")
    (tmp_path / "x.py").write_text("")
    assert main(["launch", "--config", str(launch), "--verbose", "--dry-run", str(tmp_path / "x.py")]) == 0


def test_a_flag_is_never_taken_for_the_start_of_a_longer_one(capsys):
    # argparse's default: `--bucket my-runs` (a flag of `ddpkit sky`) read as --bucket-mb, and
    # `--save-every-m 5` as whichever flag it starts uniquely. A flag is its whole spelling.
    from ddpkit.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "wine", "--bucket", "25", "--dry-run"])
    assert e.value.code == 2
    assert "unrecognized arguments: --bucket 25" in capsys.readouterr().err
