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
