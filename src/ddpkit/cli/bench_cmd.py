"""`ddpkit bench`: does DDP pay off here? All-reduce bandwidth and latency, and a task's step split
into data, compute and communication, at each process count."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .options import option
from .parser import Command

BENCH_HELP = (
    "Does DDP pay off here? All-reduce bus bandwidth and latency across message sizes (as nccl-tests reports "
    "them) and the task's step split into data, compute and communication, at each process count."
)


@dataclass(frozen=True)
class BenchOptions:
    task: str = option("wine", "task for the step-time breakdown (default wine)", positional=True)
    nproc: str = option("1,2", "comma-separated process counts")
    what: str = option("allreduce,step", "allreduce, step, or both", default_help="both")
    sizes: str = option("4,1K,64K,1M,16M", "all-reduce message sizes in bytes, K/M/G suffixes")
    iters: int = option(50, "all-reduces per size, back to back")
    steps: int = option(20, "timed training steps per mode")
    json: str | None = option(help="also write the measurements as JSON", metavar="PATH")


def cmd_bench(ns: argparse.Namespace) -> int:
    from ..tools.bench import main_bench

    return main_bench(ns)


COMMAND = Command(
    cmd_bench,
    "measure all-reduce bandwidth/latency and a task's step time at 1..N processes",
    BENCH_HELP,
    names=("batch_size", "threads", "backend", "grad_sync", "device", "timeout"),
    options=BenchOptions,
    quick_exit=True,
)
