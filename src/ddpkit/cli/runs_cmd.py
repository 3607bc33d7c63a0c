"""`ddpkit runs`: one line per run in a folder, how it ended and whether it can resume."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .options import option
from .parser import Command

RUNS_HELP = (
    "List the runs in a folder (default runs/): task, world size, strategy, optimizer steps done/planned, the "
    "final train and eval loss, how the run ended (finished; stopped: by a --save-on-signal signal, with a "
    "checkpoint; interrupted: by Ctrl-C or a TERM without one; failed: with the error; killed: no end "
    "recorded and its rank 0 (on this host) is gone; running?: no end recorded, still running or killed "
    "elsewhere) and whether a "
    "checkpoint whose header loads is there to resume from."
)


@dataclass(frozen=True)
class RunsOptions:
    folder: str = option(
        "runs", "the folder of run directories, or one run directory (default runs)", positional=True, metavar="DIR"
    )
    json: bool = option(False, "print every run's values as JSON")


def cmd_runs(ns: argparse.Namespace) -> int:
    from ..tools.runs import main_runs

    return main_runs(ns.folder, ns.json)


COMMAND = Command(
    cmd_runs,
    "one line per run in a folder: task, world size, steps, losses, how it ended, resumable",
    RUNS_HELP,
    options=RunsOptions,
)
