"""`ddpkit sky`: write a SkyPilot task YAML that runs `ddpkit train` on every node of a cluster.
What goes into the task is engines/skypilot.py's; here the flags and the help."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .flags import ENGINE_RULE
from .options import option
from .parser import Command
from .train_cmd import engine_command

SKY_HELP = f"""Write a SkyPilot task YAML that runs `ddpkit train` on every node of a cluster. SkyPilot
runs the task's `run` line once per node; ddpkit reads SkyPilot's variables (SKYPILOT_NODE_RANK,
SKYPILOT_NODE_IPS, SKYPILOT_NUM_NODES, SKYPILOT_NUM_GPUS_PER_NODE) as its node flags and starts
one worker per GPU. By default the task is a managed job (`sky jobs launch`): SkyPilot recovers
it after a preemption or a failure and ddpkit resumes from the newest checkpoint, in a run
directory on a bucket (--bucket) or a shared volume (--volume) that outlives the nodes. Example:

  ddpkit sky --nodes 2 --gpus-per-node 8 --accelerator H100 --bucket my-runs -- wine --epochs 100

{ENGINE_RULE}
"""


@dataclass(frozen=True)
class SkyOptions:
    nodes: int | None = option(help="nodes to ask for (num_nodes)", type=int, default_help="[launch] nodes, or 1")
    gpus_per_node: int | None = option(
        help="GPUs per node; one worker per GPU", type=int, default_help="[launch] gpus_per_node, or 0: CPU nodes"
    )
    accelerator: str | None = option(help="the GPU type, e.g. H100 (or H100:8)", default_help="[launch] accelerator")
    cloud: str | None = option(help="the cloud, e.g. aws, gcp, kubernetes", default_help="[launch] cloud, or any")
    image: str | None = option(help="the container image the task runs in", default_help="[launch] image")
    cpus_per_worker: int | None = option(
        help="CPU cores per worker (the node asks for this x workers, at least)",
        type=int,
        default_help="[launch] cpus_per_worker",
    )
    memory: str | None = option(help="host memory per node, at least, e.g. 256GiB", default_help="[launch] memory")
    bucket: str | None = option(
        help="a bucket for the run directory, mounted at /ddpkit on every node: a name (SkyPilot makes it) "
        "or a URI (s3://..., gs://...)"
    )
    bucket_mode: str = option("MOUNT", "how the bucket is mounted (SkyPilot's mode)", choices=("MOUNT", "MOUNT_CACHED"))
    volume: str | None = option(
        help="a SkyPilot volume (e.g. a Kubernetes PVC) for the run directory, mounted at /ddpkit",
        default_help="[launch] volume",
    )
    run_dir: str | None = option(
        help="the run directory on the nodes, or a bucket s3://BUCKET/PREFIX each node's ddpkit train keeps it in",
        default_help="[launch] run_dir, or /ddpkit/JOB_NAME-TIME on a bucket or volume",
    )
    shared_run_dir: bool = option(
        False,
        "the run directory is shared by the nodes though it is on no bucket or volume of the task (a shared "
        "file system of the image): do not refuse a multi-node job for it",
    )
    job_name: str | None = option(
        help="the task's name (of the managed job or cluster), also of its run directory",
        default_help="[launch] job_name, or ddpkit",
    )
    unmanaged: bool = option(
        False, "a plain task for `sky launch` (no job recovery) instead of a managed job for `sky jobs launch`"
    )
    recovery: str = option(
        "EAGER_NEXT_REGION", "SkyPilot's job recovery strategy", choices=("EAGER_NEXT_REGION", "FAILOVER")
    )
    max_restarts_on_errors: int = option(
        0, "also recover a managed job this many times after it failed (not only after a preemption)", type=int
    )
    install: list[str] | None = option(
        help="a setup command run once on every node, e.g. 'pip install ddpkit' (repeat for several)",
        append=True,
        metavar="COMMAND",
    )
    secret: list[str] | None = option(
        help="an environment variable every node gets, its value from the shell you launch from (SkyPilot's "
        "secrets, e.g. AWS_ACCESS_KEY_ID for a --run-dir s3://...): its name in the YAML, never its value "
        "(repeat for several)",
        append=True,
        metavar="NAME",
    )
    workdir: str | None = option(help="a local folder SkyPilot copies to every node and runs the task in")
    yaml: str | None = option(help="where to write the task YAML", default_help="JOB_NAME.sky.yaml", metavar="FILE")
    dry_run: bool = option(False, "print the task YAML; write nothing")
    config: str | None = option(
        help="the training settings from a TOML, YAML or JSON file: checked now, copied to every node and read by "
        "`ddpkit train --config` (the arguments after -- win over it); its [launch] table describes the job "
        "(the flags of `ddpkit sky` win over it)",
        metavar="FILE",
    )


def cmd_sky(ns: argparse.Namespace) -> int:
    from ..engines.skypilot import sky_command

    return engine_command(sky_command, ns)


COMMAND = Command(
    cmd_sky,
    "write a SkyPilot task YAML that runs `ddpkit train` on N nodes (a managed job, recovered)",
    SKY_HELP,
    options=SkyOptions,
    formatter=argparse.RawDescriptionHelpFormatter,
    engine=True,
)
