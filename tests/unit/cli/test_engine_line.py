"""One rule for every engine's command line: `ddpkit slurm|k8s|sky|ray [engine flags] -- TASK
[train flags]`. The arguments after -- reach the engine exactly as they would follow `ddpkit
train`; a task or a flag of `ddpkit train` before the -- is refused in one line (exit 2) that
shows the same command in the one order that is read, and that line itself runs."""

import shlex
from pathlib import Path

import pytest

from ddpkit.cli import build_parser, main
from ddpkit.cli.flags import ENGINE_RULE

DOCS = Path(__file__).resolve().parents[3] / "docs"
PAGES = {"slurm": "slurm.md", "k8s": "kubernetes.md", "sky": "skypilot.md", "ray": "ray.md"}

ENGINES = ("slurm", "k8s", "sky", "ray")


@pytest.mark.parametrize("engine", ENGINES)
def test_the_arguments_after_dashes_are_the_train_arguments_unchanged(engine):
    train = ["digits", "--epochs", "2", "--run-dir", "/tmp/r", "--", "--not-a-flag"]
    ns = build_parser().parse_args([engine, "--dry-run", "--", *train])
    assert ns.dry_run and ns.train_args == train  # everything after the first --, the later -- included
    assert build_parser().parse_args([engine, "--dry-run"]).train_args == []  # the default task
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert sub.choices[engine].format_usage() == f"usage: ddpkit {engine} [{engine} flags] -- TASK [train flags]\n"
    # the same words in the command's help and on its page
    said = " ".join(ENGINE_RULE.split())
    assert said in " ".join(sub.choices[engine].format_help().split())
    page = " ".join((DOCS / PAGES[engine]).read_text().split())
    rule = said[0].lower() + said[1:].replace("then --,", "then `--`,")
    assert f"`ddpkit {engine} [{engine} flags] -- TASK [train flags]`: " + rule in page


OLD_FORMS = [
    # the k8s form that read its own flags after the task
    (["k8s", "wine", "--image", "i", "--run-dir", "/tmp/run", "--dry-run", "--", "--epochs", "2"],
     "ddpkit k8s --image i --run-dir /tmp/run --dry-run -- wine --epochs 2"),
    # the ray form that took the train flags as its own
    (["ray", "wine", "--workers", "2", "--dry-run", "--epochs", "2", "--run-dir", "/tmp/r"],
     "ddpkit ray --workers 2 --dry-run -- wine --epochs 2 --run-dir /tmp/r"),
    (["ray", "--epochs", "2", "--dry-run", "wine"], "ddpkit ray --dry-run -- --epochs 2 wine"),
    # slurm and sky without the --
    (["sky", "--dry-run", "wine", "--epochs", "2"], "ddpkit sky --dry-run -- wine --epochs 2"),
    (["slurm", "--dry-run", "--nodes", "1", "wine", "--no-shuffle"],
     "ddpkit slurm --dry-run --nodes 1 -- wine --no-shuffle"),
]  # fmt: skip


@pytest.mark.parametrize("argv, new", OLD_FORMS, ids=[a[0] + "-" + a[1] for a, _ in OLD_FORMS])
def test_an_old_form_is_one_line_that_shows_the_new_form_and_the_new_form_runs(
    argv, new, capsys, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    engine = argv[0]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"ddpkit {engine}: error: the task and the flags of `ddpkit train` go after -- "
        f"(ddpkit {engine} [{engine} flags] -- TASK [train flags]): {new}"
    ]
    if engine == "k8s":
        pytest.importorskip("kubeflow_trainer_api")
    assert main(shlex.split(new)[1:]) == 0, capsys.readouterr().err  # the line shown is right
    assert list(tmp_path.iterdir()) == []  # a dry run: nothing written


def test_a_flag_neither_the_engine_nor_train_has_is_unrecognized_not_moved(capsys):
    with pytest.raises(SystemExit) as e:
        main(["slurm", "--nodez", "2", "--", "wine"])
    assert e.value.code == 2
    assert (
        capsys.readouterr().err.strip()
        == "ddpkit slurm: error: unrecognized arguments: --nodez (see ddpkit slurm --help)"
    )
