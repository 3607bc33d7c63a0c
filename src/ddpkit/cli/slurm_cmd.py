"""`ddpkit slurm`: write (and submit) an sbatch script that runs `ddpkit train` on every node of
an allocation. What goes into the job is engines/slurm.py's; here the flags and the help."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .flags import ENGINE_RULE
from .options import option
from .parser import Command
from .train_cmd import engine_command

SLURM_HELP = f"""Write an sbatch script that runs `ddpkit train` on every node of a SLURM allocation:
one srun task per GPU (per worker on CPU nodes), each task one ddpkit worker that reads its
rank from SLURM, started through `srun --kill-on-bad-exit=1`. The job asks for a warning
signal before its time limit; ddpkit then checkpoints at the next step, requeues the job,
and the requeued job resumes. Example:

  ddpkit slurm --nodes 2 --gpus-per-node 8 --time 04:00:00 --submit -- wine --epochs 100

{ENGINE_RULE}
"""


@dataclass(frozen=True)
class SlurmOptions:
    nodes: int | None = option(help="nodes to ask for", type=int, default_help="[launch] nodes, or 1")
    gpus_per_node: int | None = option(
        help="GPUs per node; one task (worker) per GPU",
        type=int,
        default_help="[launch] gpus_per_node, or 0: CPU nodes",
    )
    ntasks_per_node: int | None = option(
        help="workers per node on CPU nodes", type=int, default_help="[launch] workers_per_node, GPUs per node, or 1"
    )
    cpus_per_task: int | None = option(help="CPU cores per worker", type=int, default_help="[launch] cpus_per_worker")
    mem: str | None = option(help="memory per node, e.g. 64GiB (sbatch --mem)", default_help="[launch] memory")
    time: str | None = option(help="time limit, e.g. 02:00:00", default_help="[launch] time")
    partition: str | None = option(help="the SLURM partition to run in", default_help="[launch] partition")
    account: str | None = option(help="the SLURM account to charge", default_help="[launch] account")
    job_name: str | None = option(
        help="the job's name, also of its run directory (runs/JOB_NAME-TIME) without --run-dir",
        default_help="[launch] job_name, or ddpkit",
    )
    shared_run_dir: bool = option(
        False,
        "the run directory is shared by the nodes though its file system looks local (one machine; "
        "a file system ddpkit does not know): do not refuse a multi-node job for it",
    )
    exclude_slow: bool = option(
        False,
        "at ddpkit's requeue after the warning signal, leave out a node the straggler view named slow at the "
        "last 2 checks in a row (its ExcNodeList, as sbatch --exclude), unless the partition could not run "
        "the job without it",
        default_help="[launch] exclude_slow",
    )
    output: str | None = option(help="log file pattern", default_help="RUN_DIR/slurm-%%j.out")
    signal: str = option(
        "USR2@90",
        "warning signal before the time limit: save, requeue, resume",
        default_help="USR2@90, not USR1, which NCCL and other libraries may handle; '' = none",
    )
    array: str | None = option(
        help="a job array (sbatch --array, e.g. 0-3): each element trains in RUN_DIR/INDEX and is requeued on its own"
    )
    script: str | None = option(help="where to write the script", default_help="RUN_DIR/job.sbatch")
    dry_run: bool = option(False, "print the script; write and submit nothing")
    submit: bool = option(False, "submit it with sbatch; print the job id and log path")
    wait: bool = option(False, "with --submit: follow the job (through requeues) to its end and exit with its status")
    wait_timeout: float | None = option(
        help="give up waiting after this many seconds (the job keeps running)", type=float
    )
    config: str | None = option(
        help="the training settings from a TOML, YAML or JSON file: checked now, read by `ddpkit train --config` "
        "in the job (the arguments after -- win over it); its [launch] table describes the job "
        "(the flags of `ddpkit slurm` win over it)",
        metavar="FILE",
    )


def cmd_slurm(ns: argparse.Namespace) -> int:
    from ..engines.slurm import slurm_command

    return engine_command(slurm_command, ns)


COMMAND = Command(
    cmd_slurm,
    "write (and submit) an sbatch script that runs `ddpkit train` on N nodes",
    SLURM_HELP,
    options=SlurmOptions,
    formatter=argparse.RawDescriptionHelpFormatter,
    engine=True,
)
