"""A crafted run folder (config.json and summary.json that are not objects, metrics.jsonl lines
that are not records) is listed and labelled without a traceback."""

from ddpkit.reporting.plot import run_label
from ddpkit.tools.runs import describe_run


def test_json_files_that_are_not_objects_are_read_as_missing(tmp_path):
    (tmp_path / "config.json").write_text('"x"\n')
    (tmp_path / "summary.json").write_text("[1]\n")
    (tmp_path / "metrics.jsonl").write_text('[1,2]\n"x"\nnull\n')
    run = describe_run(tmp_path)
    assert (run["task"], run["world_size"], run["steps_done"]) == (None, None, None), run
    assert run_label(tmp_path) == tmp_path.resolve().name


def test_plot_leaves_out_metrics_lines_that_are_not_records(tmp_path):
    from ddpkit.reporting.plot import plot_runs

    run = tmp_path / "run"
    run.mkdir()
    good = '{"epoch": 1, "train_loss": 0.5, "eval_loss": 0.6}'
    (run / "metrics.jsonl").write_text(f'3\n"x"\n[1]\n{{"epoch": "zz"}}\n{{"epoch": 1, "train_lo\n{good}\n')
    out = plot_runs([str(run)], str(tmp_path / "curves.png"), None, None)
    assert out.stat().st_size > 1000


def test_values_of_the_wrong_type_show_as_missing_not_as_if_recorded(tmp_path):
    from ddpkit.tools.runs import format_table

    (tmp_path / "config.json").write_text('{"task": 3, "nproc": true, "max_steps": "9"}\n')
    (tmp_path / "summary.json").write_text(
        '{"steps_done": "zz", "train_loss": Infinity, "eval_loss": "x", "world_size": -2, "strategy": [1], '
        '"epochs_done": 1.5, "time": {"percent": {"compute": "x", "data": NaN}}}\n'
    )
    run = describe_run(tmp_path)
    for key in ("task", "world_size", "strategy", "steps_done", "steps_planned", "epochs_done", "train_loss"):
        assert run[key] is None, (key, run)
    assert run["eval_loss"] is None and run["time"]["percent"] == {}
    row = format_table([run]).splitlines()[1].split()
    assert row[1:8] == ["-"] * 7 and "zz" not in format_table([run]) and "inf" not in format_table([run])


def test_a_run_whose_rank_0_is_gone_without_an_end_shows_killed(tmp_path):
    import json
    import socket
    import subprocess

    from ddpkit.checkpoint.world_mark import MARK_FILE

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process has now
    (tmp_path / "config.json").write_text('{"task": "wine"}\n')
    (tmp_path / MARK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": gone.pid}) + "\n")
    assert describe_run(tmp_path)["state"] == "killed"
    (tmp_path / MARK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": 1}) + "\n")
    assert describe_run(tmp_path)["state"] == "running?"  # its rank 0 (pid 1 here) still runs


def test_linked_run_files_are_not_read_and_a_resume_through_them_is_refused(tmp_path):
    import pytest

    from ddpkit.config import RunConfig
    from ddpkit.errors import DdpkitError
    from ddpkit.reporting.plot import plot_runs
    from ddpkit.run.train import prepare_local_run

    outside = tmp_path / "outside.json"
    outside.write_text('{"steps_done": 7, "world_size": 4, "train_loss": 0.25, "epoch": 1}\n')
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text('{"task": "wine"}\n')
    for name in ("summary.json", "failed.json", "metrics.jsonl"):
        (run / name).symlink_to(outside)
    found = describe_run(run)
    assert (found["steps_done"], found["world_size"], found["train_loss"], found["state"]) == (
        None,
        None,
        None,
        "running?",
    )
    assert run_label(run) == "run"
    with pytest.raises(DdpkitError, match="metrics.jsonl is a symbolic link"):
        plot_runs([str(run)], str(tmp_path / "c.png"), None, None)
    with pytest.raises(DdpkitError, match=r"summary.json is a symbolic link \(to .*outside.json\)"):
        prepare_local_run(RunConfig(task="wine", run_dir=str(run), resume=True))
    assert outside.read_text().startswith('{"steps_done": 7')  # nothing was written through a link
