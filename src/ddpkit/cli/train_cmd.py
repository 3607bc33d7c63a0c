"""`ddpkit train`: train a task over local workers, or as one worker under torchrun / srun."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass
from typing import Any, Callable

from ..util.envvars import REQUEUE_FILE_VAR
from .flags import config_from
from .options import PLAN_ONLY, config_option, option
from .parser import ALL_GROUPS, Command, parse_args

TRAIN_HELP = """Train a task with DDP or FSDP (--strategy) over local worker processes (or as one worker, \
when started by
torchrun / srun). TASK is a built-in (wine, digits), MODULE:FUNCTION or path/to/file.py:FUNCTION;
the function returns ddpkit.Task(model=, train_set=, optimizer=, [eval_set=, loss_fn=, metric=])."""


@dataclass(frozen=True)
class TrainOptions:
    dry_run: bool = option(False, PLAN_ONLY)
    config: str | None = config_option()


def cmd_train(ns: argparse.Namespace) -> int:
    if ns.save_on_signal and os.environ.get(REQUEUE_FILE_VAR) and "SLURM_STEP_ID" in os.environ:
        # a task of the script `ddpkit slurm` writes is the worker itself: a time-limit warning that
        # comes while torch loads must not kill it
        from ..training.signals import install_early

        install_early(ns.save_on_signal.split(","))
    from ..run.train import train

    train(config_from(ns), dry_run=ns.dry_run, _clean_parent=True)
    return 0


COMMAND = Command(
    cmd_train,
    "train a task (default: the guide's Wine task)",
    TRAIN_HELP,
    ALL_GROUPS,
    ("task",),
    options=TrainOptions,
    quick_exit=True,
    compact=True,
)


def engine_command(run: Callable[..., int], opts: Any) -> int:
    """An engine's command (`ddpkit slurm`, `k8s`, `sky`, `ray`: engines/) run with its options `opts`:
    handed the command line that heads the job it writes, and how the `ddpkit train` arguments
    after -- are parsed and checked (this command's parser, its RunConfig)."""
    return run(
        opts,
        "ddpkit " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        parse_train=lambda args: parse_args({"train": COMMAND}, ["train", *args]),
        train_config=config_from,
    )
