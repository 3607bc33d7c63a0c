"""`ddpkit verify`: is a task exact at any world size? Its parameters compared step by step at 1
and N processes (it takes every flag of train: paste a train command, say verify)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .flags import config_from
from .options import option
from .parser import ALL_GROUPS, Command

VERIFY_HELP = (
    "Train the task for a few optimizer steps at one global batch G (= --nproc x --batch-size x --accumulate) "
    "as 1 x G, N x G/N and 1 x G/2 accumulating 2, checkpoint the N-process run part way and resume a copy, and "
    "compare the parameters after every step (in float64 where the task allows it; the model's nn.Dropout off, "
    "named). Prints the largest drift per parameter, the first step over the tolerance and the cause the evidence "
    "points to; exit 0 when the task is exact, 1 when it drifts, 3 when the training draws random numbers verify "
    "cannot turn off (turn them off and verify again), 2 for bad input. Takes every flag of train."
)


@dataclass(frozen=True)
class VerifyOptions:
    steps: int = option(6, "optimizer steps each run trains and compares (the round trip resumes after half)")


def cmd_verify(ns: argparse.Namespace) -> int:
    from ..tools.verify import verify

    report = verify(config_from(ns), steps=ns.steps, _clean_parent=True)
    print(report["text"], flush=True)
    return report["exit_code"]


COMMAND = Command(
    cmd_verify,
    "is a task exact at any world size? compare its parameters step by step at 1 and N processes",
    VERIFY_HELP,
    ALL_GROUPS,
    ("task",),
    options=VerifyOptions,
    quick_exit=True,
    compact=True,
)
