"""Curves of runs as one PNG: loss, the eval metric and samples/s per epoch, runs side by side.

`ddpkit plot RUN_DIR [RUN_DIR...]` calls `plot_runs`; code that has its records in memory
calls `plot_curves` with {label: [record, ...]} directly, where a record is one line of
metrics.jsonl. `plot_bars` draws the benchmark suite's comparison of variants (wall time or
samples/s per workload). Drawing uses matplotlib's Agg canvas without pyplot, so it needs
no display and leaves the caller's (a notebook's) matplotlib backend alone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import DdpkitError
from ..util.textfile import read_own_text
from .metrics import read_metrics

Records = Sequence[Mapping[str, Any]]


def plot_curves(curves: Mapping[str, Records], out: str | os.PathLike, title: str | None = None) -> Path:
    """Write a PNG with three panels (loss, eval metric, samples/s) over epochs, one colour per
    label; eval loss is dashed beside the solid train loss. Returns the path written."""
    if not curves:
        raise DdpkitError("nothing to plot: give at least one run")
    metric = _metric_key(curves)
    fig = _figure((15, 4.6))
    ax_loss, ax_metric, ax_speed = fig.subplots(1, 3)
    colours = [f"C{i % 10}" for i in range(len(curves))]
    for (label, records), colour in zip(curves.items(), colours, strict=True):
        _line(ax_loss, records, "train_loss", colour, f"{label} train", "-")
        _line(ax_loss, records, "eval_loss", colour, f"{label} eval", "--")
        if metric:
            _line(ax_metric, records, metric, colour, label, "-", marker=True)
        speeds = sorted(r["samples_per_s"] for r in records if r.get("samples_per_s"))
        median = f", median {speeds[len(speeds) // 2]:,.0f}/s" if speeds else ""
        _line(ax_speed, records, "samples_per_s", colour, label + median, "-")
    ax_loss.set(title="loss (global mean over all ranks)", xlabel="epoch", ylabel="loss")
    if all(
        r.get(k, 1) > 0
        for rs in curves.values()
        for r in rs
        for k in ("train_loss", "eval_loss")
        if r.get(k) is not None
    ):
        ax_loss.set_yscale("log")
    ax_metric.set(
        title=f"eval {metric[5:]}" if metric else "eval metric", xlabel="epoch", ylabel=metric[5:] if metric else ""
    )
    if not metric:
        ax_metric.text(0.5, 0.5, "no evaluation in these runs", ha="center", va="center", transform=ax_metric.transAxes)
    ax_speed.set(title="training throughput", xlabel="epoch", ylabel="samples/s (all ranks)")
    ax_speed.set_ylim(bottom=0)
    for ax in (ax_loss, ax_metric, ax_speed):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    return _save(fig, out, dpi=100)


def plot_bars(
    panels: Mapping[str, Sequence[Mapping[str, Any]]],
    out: str | os.PathLike,
    xlabels: Mapping[str, str] | None = None,
    title: str | None = None,
    part_label: str = "training loop",
    rest_label: str = "outside training (imports, launch, setup, teardown)",
) -> Path:
    """Horizontal bars comparing variants, one panel per workload. `panels` maps a panel
    title to bars {"name", "median", "min", "max"} (whiskers span min..max); a bar that also
    has "part" (e.g. the training time inside the wall time) is split into that part and
    the rest. Returns the path written."""
    if not panels:
        raise DdpkitError("nothing to plot: no results")
    heights = [max(1.5, 0.45 * len(bars) + 1) for bars in panels.values()]
    fig = _figure((9, sum(heights) + 0.5))
    axes = fig.subplots(len(panels), 1, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    for ax, (name, bars) in zip(axes, panels.items(), strict=True):
        bars = list(bars)[::-1]  # the first bar on top
        y = list(range(len(bars)))
        med = [b["median"] for b in bars]
        whiskers = [
            [m - b["min"] for m, b in zip(med, bars, strict=True)],
            [b["max"] - m for m, b in zip(med, bars, strict=True)],
        ]
        if any("part" in b for b in bars):
            part = [min(b.get("part", 0.0), m) for b, m in zip(bars, med, strict=True)]
            ax.barh(y, part, color="#d62728", label=part_label)
            ax.barh(y, [m - p for m, p in zip(med, part, strict=True)], left=part, color="#1f77b4", label=rest_label)
            ax.errorbar(med, y, xerr=whiskers, fmt="none", ecolor="black", capsize=3, lw=1)
            ax.legend(loc="lower right", fontsize=8)
        else:
            ax.barh(y, med, xerr=whiskers, color="#2ca02c", capsize=3)
        for yi, m in zip(y, med, strict=True):
            ax.text(m, yi, f" {m:,.0f}" if abs(m) >= 100 else f" {m:.3g}", va="center", fontsize=8)
        ax.set_yticks(y)
        ax.set_yticklabels([b["name"] for b in bars], fontsize=8)
        ax.set_xlabel((xlabels or {}).get(name, ""))
        ax.set_title(name or (title or ""), fontsize=10)
        ax.margins(x=0.15)
    if title:
        fig.suptitle(title, fontsize=11)
    return _save(fig, out, dpi=110)


def plot_runs(
    run_dirs: Sequence[str | os.PathLike],
    out: str | os.PathLike | None = None,
    labels: Sequence[str] | None = None,
    title: str | None = None,
) -> Path:
    """Plot run directories (each with a metrics.jsonl). Default output: RUN_DIR/curves.png
    for one run, ./curves.png to compare several."""
    if labels is not None and len(labels) != len(run_dirs):
        raise DdpkitError(f"{len(labels)} labels for {len(run_dirs)} runs: give one --label per run")
    curves: dict[str, Records] = {}
    for i, run_dir in enumerate(run_dirs):
        if not (Path(run_dir) / "metrics.jsonl").is_file():
            raise DdpkitError(f"{run_dir} has no metrics.jsonl: give the run directories of `ddpkit train`")
        if (Path(run_dir) / "metrics.jsonl").is_symlink():
            raise DdpkitError(f"{run_dir}/metrics.jsonl is a symbolic link: ddpkit plots only what a run wrote itself")
        label = labels[i] if labels else run_label(run_dir)
        if label in curves:
            label = f"{label} [{run_dir}]"
        curves[label] = read_metrics(run_dir)
    if out is None:
        out = Path(run_dirs[0]) / "curves.png" if len(run_dirs) == 1 else Path("curves.png")
    return plot_curves(curves, out, title)


def run_label(run_dir: str | os.PathLike) -> str:
    """`NAME (N processes)`, from the run's summary.json or config.json."""
    run_dir = Path(run_dir)
    world = None
    for name, key in (("summary.json", "world_size"), ("config.json", "nproc")):
        try:
            found = json.loads(read_own_text(run_dir / name))
        except (OSError, ValueError):
            continue
        world = found.get(key) if isinstance(found, dict) else None  # a crafted file: no label from it
        if world:
            break
    name = run_dir.resolve().name
    return f"{name} ({world} process{'es' if world != 1 else ''})" if world else name


def _figure(size: tuple[float, float]) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise DdpkitError("plotting needs matplotlib: pip install 'ddpkit[plot]' (or matplotlib)") from None
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, out: str | os.PathLike, dpi: int) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    return out


def _metric_key(curves: Mapping[str, Records]) -> str | None:
    for records in curves.values():
        for r in records:
            for k in r:
                if k.startswith("eval_") and k != "eval_loss":
                    return k
    return None


def _line(ax: Any, records: Records, key: str, colour: str, label: str, style: str, marker: bool = False) -> None:
    points = [(r["epoch"], r[key]) for r in records if r.get(key) is not None]
    if points:
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, style, color=colour, label=label, marker="." if marker and len(points) < 40 else None)
