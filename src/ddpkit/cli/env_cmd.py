"""`ddpkit env`: what a bug report needs (versions, devices, launcher, network, known traps)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .options import option
from .parser import Command

ENV_HELP = (
    "Print versions (Python, torch, CUDA, NCCL, gloo), devices and memory, the launcher environment (torchrun / "
    "SLURM / none) with the resolved ranks, the network interface and master address, what `ddpkit train` would "
    "do here, and warnings for known traps. Starts no process group."
)


@dataclass(frozen=True)
class EnvOptions:
    json: bool = option(False, "print the report as JSON")


def cmd_env(ns: argparse.Namespace) -> int:
    import json

    from ..tools.doctor import collect, format_report

    report = collect(nproc=ns.nproc)
    print(json.dumps(report, indent=2) if ns.json else format_report(report))
    return 0


COMMAND = Command(
    cmd_env,
    "what a bug report needs: versions, devices, launcher, network, and known traps",
    ENV_HELP,
    names=("nproc",),
    options=EnvOptions,
)
