"""`ddpkit plot`: the metrics of one or more runs as one PNG, side by side."""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass

from .options import option
from .parser import Command

PLOT_HELP = (
    "Plot the metrics.jsonl of one or more run directories into one PNG: loss, the eval metric and samples/s per "
    "epoch, e.g. 1 vs 2 vs 4 processes."
)


@dataclass(frozen=True)
class PlotOptions:
    run_dirs: list[str] | None = option(
        help="run directories of `ddpkit train`", positional=True, nargs="+", metavar="RUN_DIR"
    )
    out: str | None = option(
        help="the PNG to write",
        flag="-o",
        aliases=("--out",),
        default_help="RUN_DIR/curves.png for one run, ./curves.png for several",
    )
    label: list[str] | None = option(
        help="a legend label per run, in order", append=True, type=str, default_help="NAME (N processes)"
    )
    title: str | None = option(help="a title over the panels")


def cmd_plot(ns: argparse.Namespace) -> int:
    from ..reporting.plot import plot_runs
    from ..storage.copy import local_output, local_run, shown_as
    from ..storage.location import is_url

    with contextlib.ExitStack() as stack:
        out = stack.enter_context(local_output(ns.out))  # an --out URL: written here, then uploaded
        if not any(is_url(d) for d in ns.run_dirs):
            wrote = plot_runs(ns.run_dirs, out, ns.label, ns.title)
        else:  # a run in a bucket: its files downloaded, the picture written here
            runs = [str(stack.enter_context(local_run(d, checkpoint=False))) for d in ns.run_dirs]
            labels = ns.label or [str(d).rstrip("/").rsplit("/", 1)[-1] for d in ns.run_dirs]
            wrote = plot_runs(runs, out or "curves.png", labels, ns.title)
        line = shown_as(out, ns.out)(f"wrote {wrote}")
    print(line)  # after the upload
    return 0


COMMAND = Command(
    cmd_plot, "PNG curves of runs (loss, eval accuracy, samples/s), side by side", PLOT_HELP, options=PlotOptions
)
