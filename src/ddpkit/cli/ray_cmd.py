"""`ddpkit ray`: train a task in Ray Train's workers on a Ray cluster. What goes into the job is
engines/ray.py's (ddpkit.train_on_ray); here the flags and the help."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .flags import ENGINE_RULE
from .options import PLAN_ONLY, option
from .parser import Command
from .train_cmd import engine_command

RAY_HELP = f"""Train a task in the workers of Ray Train (a TorchTrainer) on a Ray cluster: Ray places the
workers and makes their process group, each runs ddpkit's worker, so the model, the checkpoints
in --run-dir and the data position are those of `ddpkit train` at the same global batch. The run
directory must be on storage every node sees. A worker that fails or dies makes Ray restart the
group (--max-restarts times, Ray's FailureConfig); it resumes from the run directory's newest
checkpoint. After -- the flags of `ddpkit train`, except where the workers run (Ray's). Example:

  ddpkit ray --workers 4 --address 10.0.0.1:6379 -- wine --run-dir /shared/runs/wine --max-restarts 3

{ENGINE_RULE}
"""


@dataclass(frozen=True)
class RayOptions:
    workers: int | None = option(
        help="Ray Train workers in all (one per GPU on GPU nodes)",
        type=int,
        default_help="[launch] nodes x workers_per_node, or 1",
    )
    address: str | None = option(
        help="the Ray cluster (ray.init's address: HOST:PORT, ray://HOST:10001, auto)",
        default_help="[launch] address, else RAY_ADDRESS, else a new local Ray",
    )
    nodes: int | None = option(
        help="nodes to spread the workers over (1: all on one node)",
        type=int,
        default_help="[launch] nodes, else wherever Ray finds room",
    )
    workers_per_node: int | None = option(
        help="workers per node", type=int, default_help="[launch] workers_per_node, GPUs per node, or 1"
    )
    gpus_per_node: int | None = option(
        help="GPUs per node; one worker per GPU", type=int, default_help="[launch] gpus_per_node, or 0: CPU workers"
    )
    cpus_per_worker: int | None = option(
        help="CPU cores Ray reserves for each worker", type=int, default_help="[launch] cpus_per_worker, or 1"
    )
    job_name: str | None = option(
        help="names the run directory (runs/JOB_NAME-TIME) without --run-dir", default_help="[launch] job_name"
    )
    shared_run_dir: bool = option(
        False,
        "the run directory is shared by the nodes though its file system looks local (one machine; "
        "a file system ddpkit does not know): do not refuse a multi-node job for it",
    )
    dry_run: bool = option(False, PLAN_ONLY)
    config: str | None = option(
        help="the training settings from a TOML, YAML or JSON file, read as `ddpkit train --config` reads it "
        "(the arguments after -- win over it); its [launch] table describes the job (the flags of "
        "`ddpkit ray` win over it)",
        metavar="FILE",
    )


def cmd_ray(ns: argparse.Namespace) -> int:
    from ..engines.ray import ray_command

    return engine_command(ray_command, ns)


COMMAND = Command(
    cmd_ray,
    "train a task in Ray Train's workers on a Ray cluster",
    RAY_HELP,
    options=RayOptions,
    formatter=argparse.RawDescriptionHelpFormatter,
    quick_exit=True,
    engine=True,
)
