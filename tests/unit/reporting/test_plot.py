"""ddpkit plot: one PNG comparing runs (loss, eval accuracy, samples/s)."""

import json

import pytest

from ddpkit import DdpkitError
from ddpkit.cli import main
from ddpkit.reporting.plot import plot_curves, run_label

mpl_image = pytest.importorskip("matplotlib.image")  # the `plot` extra

BLUE, ORANGE = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)  # matplotlib's C0 and C1


def fake_run(path, world, epochs=20, eval_every=1):
    path.mkdir()
    lines = []
    for e in range(1, epochs + 1):
        r = {"epoch": e, "train_loss": 1.0 / e, "epoch_s": 0.01, "samples_per_s": 1000.0 * world, "lr": 0.001}
        if e % eval_every == 0:
            r.update(eval_loss=1.2 / e, eval_accuracy=min(1.0, 0.5 + e / 40))
        lines.append(json.dumps(r))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (path / "summary.json").write_text(json.dumps({"world_size": world}))
    return path


def has_colour(png, rgb, tolerance=3):
    img = (mpl_image.imread(png)[..., :3] * 255).round()
    import numpy as np

    return bool((np.abs(img - np.array(rgb)).max(axis=-1) <= tolerance).any())


def test_plot_command_compares_runs_in_one_png(tmp_path, capsys):
    one, two = fake_run(tmp_path / "one", 1), fake_run(tmp_path / "two", 2, eval_every=5)
    out = tmp_path / "cmp.png"
    assert main(["plot", str(one), str(two), "-o", str(out), "--title", "1 vs 2"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    img = mpl_image.imread(out)
    assert img.shape[0] >= 400 and img.shape[1] >= 1200  # three readable panels side by side
    assert has_colour(out, BLUE) and has_colour(out, ORANGE)  # one curve colour per run


def test_one_run_is_plotted_into_its_own_directory(tmp_path, capsys):
    run = fake_run(tmp_path / "run", 2)
    assert main(["plot", str(run)]) == 0
    assert (run / "curves.png").is_file() and not has_colour(run / "curves.png", ORANGE)
    assert run_label(run) == "run (2 processes)"


def test_plot_refuses_what_is_not_a_run(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["plot", str(tmp_path / "empty")]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err
    with pytest.raises(DdpkitError, match="nothing to plot"):
        plot_curves({}, tmp_path / "x.png")


def test_without_matplotlib_the_error_says_what_to_install(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(DdpkitError, match=r"pip install 'ddpkit\[plot\]'"):
        plot_curves({"a": [{"epoch": 1, "train_loss": 1.0}]}, tmp_path / "x.png")


def test_the_benchmark_chart_is_drawn_by_ddpkit_plot(tmp_path, monkeypatch):
    """benchmarks/harness.plot reduces results to bars; ddpkit.reporting.plot.plot_bars draws them."""
    import importlib.util

    import ddpkit.reporting.plot
    from conftest import REPO

    spec = importlib.util.spec_from_file_location("bench_harness", REPO / "benchmarks" / "harness.py")
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    drawn = []
    real = ddpkit.reporting.plot.plot_bars
    monkeypatch.setattr(
        ddpkit.reporting.plot, "plot_bars", lambda panels, out, **kw: drawn.append(panels) or real(panels, out, **kw)
    )
    runs = [
        {"name": n, "workload": wl, "ok": True, "wall_s": w, "train_s": t, "samples_per_s": s}
        for n, wl, w, t, s in [
            ("a", "wine", 10.0, 2.0, 100.0),
            ("a", "wine", 12.0, 2.0, 90.0),
            ("b", "wine", 6.0, 1.0, 200.0),
            ("a", "mlp", 1.0, 1.0, 900.0),
        ]
    ]
    out = harness.plot(runs, str(tmp_path / "bench.png"), metrics={"mlp": "samples_per_s"}, title="t")
    assert drawn[0]["wine"][0] == {"name": "a", "median": 11.0, "min": 10.0, "max": 12.0, "part": 2.0}
    assert drawn[0]["mlp"] == [{"name": "a", "median": 900.0, "min": 900.0, "max": 900.0}]
    assert has_colour(out, (0xD6, 0x27, 0x28)) and has_colour(out, (0x2C, 0xA0, 0x2C))  # split wall bars, plain bars
