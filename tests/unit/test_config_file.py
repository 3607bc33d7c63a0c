"""--config FILE: TOML, YAML and JSON read into the values the flags give; flags given on the
command line win over the file, flags left out do not; a mistake names the file and the key."""

import json
import sys
from pathlib import Path

import pytest

from ddpkit import DdpkitError, RunConfig
from ddpkit.cli import main
from ddpkit.cli.commands import parse_args
from ddpkit.cli.flags import config_from
from ddpkit.config.file import RECORD_ONLY, load_config, read_config_file

TOML = """
task = "digits"
epochs = 3
batch-size = 16        # the flag's spelling
no-shuffle = true      # --no-shuffle: shuffle = false
nproc = "auto"
lr = "1e-3"            # text is read as the flag's text would be

[faults]
save_every = 0
keep-last = 2

[strategy]
precision = "fp32"

[task_args]
hidden = 8
"""

YAML = """
task: digits
epochs: 3
batch_size: 16
shuffle: false
nproc: null
lr: 1e-3               # YAML reads this as text
faults: {save-every: 0, keep_last: 2}
precision: fp32
task-arg: ["hidden=8"]  # as the repeated flag
"""

EXPECTED = RunConfig(
    task="digits", epochs=3, batch_size=16, shuffle=False, lr=1e-3, save_every=0, keep_last=2, task_args={"hidden": 8}
)


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _cfg(*argv):
    return config_from(parse_args(list(argv)))


def test_toml_yaml_and_json_give_the_same_config(tmp_path):
    as_json = json.dumps({**EXPECTED.as_dict(), "run_dir": None})
    for name, text in (("a.toml", TOML), ("a.yaml", YAML), ("a.json", as_json)):
        path = _write(tmp_path, name, text)
        assert load_config(path) == EXPECTED, name
        assert _cfg("train", "--config", path) == EXPECTED, name


def test_a_flag_given_wins_and_a_flag_left_out_does_not(tmp_path):
    path = _write(tmp_path, "a.toml", TOML)
    cfg = _cfg("train", "--config", path, "--epochs", "100", "--task-arg", "depth=2", "--keep-last", "5")
    assert cfg.epochs == 100  # given, though it is the default
    assert (cfg.batch_size, cfg.shuffle, cfg.save_every, cfg.keep_last) == (16, False, 0, 5)
    assert cfg.task_args == {"hidden": 8, "depth": 2}  # the flag adds to the file's table
    assert _cfg("train", "wine", "--config", path).task == "wine"  # the positional too


def test_a_run_config_json_reads_back_to_the_same_config_without_resume(tmp_path):
    run = RunConfig(nproc=2, seed=5, epochs=6, save_every=2, quiet=True, run_dir="runs/x", device_memory="2GiB")
    path = _write(tmp_path, "config.json", json.dumps({**run.as_dict(), "resume": True}))
    assert load_config(path) == run  # `resume` is how one command started, not a setting: ignored
    assert RECORD_ONLY == {"resume"}
    assert _cfg("train", "--config", path, "--run-dir", "new") == run.replace(run_dir="new")


def test_launch_and_check_take_the_file_too(tmp_path):
    path = _write(tmp_path, "a.toml", "epochs = 2\n[processes]\nnproc = 3\nmax-restarts = 1\n")
    launch = _cfg("launch", "--config", path, "script.py", "--epochs", "9")  # the script's own flag
    assert (launch.nproc, launch.max_restarts, launch.epochs) == (3, 1, 2)
    assert _cfg("check", "--config", path, "--nproc", "2").nproc == 2


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("epoch = 3\nbatch_szie = 4\n", "'epoch' (did you mean 'epochs'?); unknown setting 'batch_szie'"),
        ("[training]\nsave_every = 3\n", "save_every is a setting of [faults], not of [training]"),
        ("[trainin]\nepochs = 3\n", "unknown setting 'trainin' (did you mean 'training'?)"),
        ("epochs = 3\n[training]\nepochs = 4\n", "'epochs' and 'training.epochs' both set epochs"),
        ('epochs = "ten"\n', "epochs must be an integer, got 'ten'"),
        ("epochs = 2.5\n", "epochs must be an integer, got 2.5"),
        ('strategy = "zero"\n', "strategy must be one of ddp, fsdp, hsdp, auto"),
        ('nproc = "many"\n', "nproc must be a positive integer or 'auto'"),
        ('csv = "yes"\n', "csv must be true or false"),
        ("epochs = true\n", "epochs must be an integer, not true/false"),
        ("batch_size = 3\n[[x]]\n", "unknown setting 'x'"),
        ("epochs = \n", "not valid TOML"),
    ],
)
def test_mistakes_name_the_file_and_the_key(tmp_path, text, fragment):
    path = _write(tmp_path, "bad.toml", text)
    with pytest.raises(DdpkitError, match="bad.toml") as e:
        read_config_file(path)
    assert fragment in str(e.value)


def test_the_cli_prints_one_line_and_exits_2(tmp_path, capsys):
    path = _write(tmp_path, "bad.yaml", "epoch: 3\n")
    assert main(["train", "--config", path]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown setting 'epoch' (did you mean 'epochs'?)" in err
    assert main(["train", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "cannot read it" in capsys.readouterr().err
    assert main(["train", "--config", _write(tmp_path, "a.ini", "epochs=3")]) == 2
    assert ".toml, .yaml, .yml or .json" in capsys.readouterr().err


def test_yaml_without_pyyaml_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)  # as if PyYAML were not installed
    with pytest.raises(DdpkitError, match=r"pip install 'ddpkit\[yaml\]'"):
        read_config_file(_write(tmp_path, "a.yaml", "epochs: 3\n"))


def test_slurm_checks_the_file_and_hands_it_to_the_job(tmp_path, capsys):
    path = _write(tmp_path, "a.toml", "epochs = 4\n")
    assert main(["slurm", "--config", path, "--dry-run", "--", "digits", "--run-dir", str(tmp_path / "r")]) == 0
    script = capsys.readouterr().out
    assert f"--config {tmp_path / 'a.toml'}" in script and "digits" in script
    assert main(["slurm", "--config", _write(tmp_path, "b.toml", "nproc = 4\n"), "--dry-run"]) == 2
    assert "nproc = 4 in" in capsys.readouterr().err
    assert main(["slurm", "--config", _write(tmp_path, "c.toml", "epoch = 4\n"), "--dry-run"]) == 2
    assert "did you mean 'epochs'?" in capsys.readouterr().err


def _list_fields():
    """Every list-valued setting of RunConfig (--tracker today): a new one is covered here too."""
    import dataclasses

    return [
        f
        for f in dataclasses.fields(RunConfig)
        if f.default_factory is not dataclasses.MISSING and isinstance(f.default_factory(), list)
    ]


def test_there_is_a_list_valued_setting_to_test():
    assert "tracker" in [f.name for f in _list_fields()]


@pytest.mark.parametrize("field", _list_fields(), ids=lambda f: f.name)
@pytest.mark.parametrize("kind", ["toml", "yaml", "json"])
def test_a_list_valued_setting_is_read_from_a_file_as_one_value_or_a_list(tmp_path, field, kind):
    choices = list(field.metadata["choices"])
    two = choices[:2]
    dump = {"toml": lambda d: "\n".join(f"{k} = {json.dumps(v)}" for k, v in d.items()), "json": json.dumps}
    dump["yaml"] = dump["json"]  # JSON is YAML
    one = load_config(_write(tmp_path, f"one.{kind}", dump[kind]({field.name: two[0]})))
    assert getattr(one, field.name) == [two[0]]
    several = load_config(_write(tmp_path, f"two.{kind}", dump[kind]({field.name: two})))
    assert getattr(several, field.name) == two
    # as the repeated flag: the command line adds to the file's list
    flag = field.metadata.get("flag") or "--" + field.name.replace("_", "-")
    cfg = _cfg("train", "--config", str(tmp_path / f"two.{kind}"), flag, choices[-1])
    assert getattr(cfg, field.name) == list(dict.fromkeys([*two, choices[-1]]))


def test_config_files_name_trackers_and_csv_is_one_of_them(tmp_path):
    assert load_config(_write(tmp_path, "a.toml", 'tracker = "csv"\n')).csv is True
    cfg = load_config(_write(tmp_path, "b.yaml", "tracker: [mlflow, wandb]\ntensorboard: true\n"))
    assert cfg.tracker == ["mlflow", "wandb", "tensorboard"] and cfg.tensorboard is True


@pytest.mark.parametrize(
    "text, fragment",
    [
        (
            'tracker = "comet"\n',
            "tracker must be one of mlflow, wandb, tensorboard, csv (or a list of them), got 'comet'",
        ),
        ('tracker = ["csv", 3]\n', "tracker must be one of mlflow, wandb, tensorboard, csv (or a list of them), got 3"),
        ("tracker = 3\n", "tracker must be one of mlflow, wandb, tensorboard, csv (or a list of them), got 3"),
    ],
)
def test_a_bad_list_value_names_the_file_and_the_key(tmp_path, text, fragment):
    with pytest.raises(DdpkitError, match="bad.toml") as e:
        read_config_file(_write(tmp_path, "bad.toml", text))
    assert fragment in str(e.value)


def test_the_config_json_of_a_run_with_trackers_replays_it(tmp_path):
    run = RunConfig(tracker=["mlflow", "wandb"], csv=True, tracker_uri="http://127.0.0.1:5000", run_dir="runs/x")
    path = _write(tmp_path, "config.json", json.dumps({**run.as_dict(), "resume": False}))
    assert load_config(path) == run
    assert _cfg("train", "--config", path) == run
    assert _cfg("train", "--config", path, "--tracker", "mlflow", "--run-dir", "y") == run.replace(run_dir="y")


def test_slurm_takes_a_config_file_with_trackers(tmp_path, capsys):
    path = _write(tmp_path, "a.toml", 'tracker = ["csv", "tensorboard"]\n')
    assert main(["slurm", "--config", path, "--dry-run", "--", "--run-dir", str(tmp_path / "r")]) == 0
    assert f"--config {path}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "text, said",
    [
        ("epochs: 3\n  lr: 2\n", "line 2, column 5: mapping values are not allowed here"),
        ("epochs: 3\nbatch_size: [1\nlr: 2\n", "line 3, column 3: expected ',' or ']', but got ':'"),
        ('epochs: 3\nlr: "abc\n', "line 3, column 1: found unexpected end of stream"),
    ],
)
def test_a_yaml_syntax_error_names_its_line(tmp_path, text, said):
    with pytest.raises(DdpkitError) as e:
        read_config_file(_write(tmp_path, "bad.yaml", text))
    assert str(e.value) == f"{tmp_path / 'bad.yaml'}: not valid YAML: {said}"


CONFIG_FILES = Path(__file__).parent / "config_files"


def test_a_config_json_written_by_version_0_1_still_loads_and_replays_the_same_settings():
    """config-0.1.json: written by `ddpkit train wine --nproc 2 --epochs 1 --lr 0.01 --tracker csv
    --batch-size 16 --strategy fsdp` before the config was split into sections (one flat
    dataclass; run_dir renamed). Every setting reads back, with its value, and is written back
    the same (the keys now come section by section)."""
    path = CONFIG_FILES / "config-0.1.json"
    text = path.read_text()
    run = load_config(str(path))
    given = (run.nproc, run.epochs, run.lr, run.batch_size, run.strategy, run.tracker)
    assert given == (2, 1, 0.01, 16, "fsdp", ["csv"])
    written = json.loads(json.dumps(run.as_dict(), indent=2))  # what the run directory gets (run_dir.py)
    old = json.loads(text)
    assert {k: written[k] for k in old} == old
    defaults = RunConfig().as_dict()  # a setting added since is written at its default
    assert all(written[k] == defaults[k] for k in set(written) - set(old))
    assert _cfg("train", "--config", str(path)) == run
