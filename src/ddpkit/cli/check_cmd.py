"""`ddpkit check`: the pre-flight check on every rank of the workers `ddpkit train` would start
(it takes every flag of train: paste a train command, say check)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .flags import config_from
from .options import config_option, option
from .parser import ALL_GROUPS, Command

CHECK_HELP = (
    "Start the workers `ddpkit train` would start with the same flags (or run as one under srun / torchrun: srun "
    "ddpkit check; every flag of train is accepted, the task and training flags are ignored) and check on every "
    "rank: a real all-reduce (latency and bandwidth, all ranks and every node pair), the backend and interface "
    "each rank chose, version parity (Python, torch, CUDA, NCCL, ddpkit), that the run directory is one shared "
    "folder, clocks, TCP ports between nodes, free memory and /dev/shm, known NCCL traps. One table and a "
    "verdict; exit 0 only when a job would run."
)


@dataclass(frozen=True)
class CheckOptions:
    json: bool = option(False, "print rank 0's report as JSON")
    config: str | None = config_option()


def cmd_check(ns: argparse.Namespace) -> int:
    from ..tools.check import main_check

    return main_check(config_from(ns), ns.json)


COMMAND = Command(
    cmd_check,
    "pre-flight: would a job run on this node / allocation? (all-reduce, versions, shared run "
    "directory, clocks, ports, memory, NCCL traps)",
    CHECK_HELP,
    ALL_GROUPS,
    ("task",),
    options=CheckOptions,
    quick_exit=True,
    compact=True,
)
