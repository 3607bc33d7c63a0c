"""`ddpkit slurm`: write (and submit) an sbatch script that runs `ddpkit train` on every node of
an allocation."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import DdpkitError
from .config_args import refuse_worker_placement, with_config_file
from .flags import config_from
from .options import option
from .parser import Command, parse_args
from .train_cmd import COMMAND as TRAIN

SLURM_HELP = """Write an sbatch script that runs `ddpkit train` on every node of a SLURM allocation:
one srun task per GPU (per worker on CPU nodes), each task one ddpkit worker that reads its
rank from SLURM, started through `srun --kill-on-bad-exit=1`. The job asks for a warning
signal before its time limit; ddpkit then checkpoints at the next step, requeues the job,
and the requeued job resumes. Example:

  ddpkit slurm --nodes 2 --gpus-per-node 8 --time 04:00:00 --submit -- wine --epochs 100
"""


@dataclass(frozen=True)
class SlurmOptions:
    nodes: int = option(1, "nodes to ask for")
    gpus_per_node: int = option(0, "GPUs per node; one task (worker) per GPU", default_help="0: CPU nodes")
    ntasks_per_node: int | None = option(
        help="workers per node on CPU nodes", type=int, default_help="GPUs per node, or 1"
    )
    cpus_per_task: int | None = option(help="CPU cores per worker", type=int)
    time: str | None = option(help="time limit, e.g. 02:00:00")
    partition: str | None = option(help="the SLURM partition to run in")
    account: str | None = option(help="the SLURM account to charge")
    job_name: str = option("ddpkit", "the job's name, also of its run directory (runs/JOB_NAME-TIME) without --run-dir")
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
        "in the job (the arguments after -- win over it)",
        metavar="FILE",
    )
    train_args: list[str] | None = option(
        help="-- then the arguments of `ddpkit train` (task and flags)", positional=True, nargs=argparse.REMAINDER
    )


def cmd_slurm(ns: argparse.Namespace) -> int:
    from ..launchers import sbatch as slurm

    args = list(ns.train_args)
    if args[:1] == ["--"]:
        args = args[1:]
    args = with_config_file(args, ns.config)
    # Check the training arguments now, not in the job an hour later.
    try:
        train_ns = parse_args({"train": TRAIN}, ["train", *args])
    except SystemExit:
        raise DdpkitError(
            "the arguments after -- are not valid `ddpkit train` arguments (see the message above)"
        ) from None
    for flag in (
        "--nproc",
        "--nproc-per-node",
        "--nnodes",
        "--node-rank",
        "--master-addr",
        "--rdzv-endpoint",
        "--master-port",
    ):
        if any(a == flag or a.startswith(flag + "=") for a in args):
            raise DdpkitError(
                f"{flag} does not belong after --: SLURM starts the workers "
                "(use --nodes / --gpus-per-node / --ntasks-per-node of `ddpkit slurm`)"
            )
    refuse_worker_placement(getattr(train_ns, "file_settings", {}), train_ns.config)
    config_from(train_ns)  # validates values
    run_dir = Path(train_ns.run_dir or f"runs/{ns.job_name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if not train_ns.run_dir:
        args += ["--run-dir", str(run_dir)]
    job = slurm.SlurmJob(
        train_args=args,
        nodes=ns.nodes,
        gpus_per_node=ns.gpus_per_node,
        tasks_per_node=ns.ntasks_per_node,
        cpus_per_task=ns.cpus_per_task,
        time=ns.time,
        partition=ns.partition,
        account=ns.account,
        job_name=ns.job_name,
        output=ns.output,
        signal=ns.signal,
        run_dir=str(run_dir),
        array=ns.array,
    )
    if ns.array and ns.wait:
        raise DdpkitError("--wait follows one job, not an array: follow its elements with squeue")
    text = slurm.render_sbatch(job, "ddpkit " + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    if ns.dry_run:
        print(text, end="")
        return 0
    script = Path(ns.script) if ns.script else run_dir / "job.sbatch"
    run_dir.mkdir(parents=True, exist_ok=True)  # SLURM cannot create the log file's folder
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(text)
    script.chmod(0o755)
    if not ns.submit:
        print(f"ddpkit: wrote {script}; submit it with: sbatch {shlex.quote(str(script))}")
        return 0
    job_id = slurm.submit(script)
    log = (ns.output or str(run_dir / "slurm-%j.out")).replace("%j", job_id)
    print(f"ddpkit: submitted job {job_id}; log: {log}", flush=True)
    if not ns.wait:
        return 0
    code = slurm.wait(job_id, timeout=ns.wait_timeout, report=lambda m: print(m, flush=True))
    print(f"ddpkit: job {job_id} ended with exit status {code}; log: {log}", flush=True)
    return code


COMMAND = Command(
    cmd_slurm,
    "write (and submit) an sbatch script that runs `ddpkit train` on N nodes",
    SLURM_HELP,
    options=SlurmOptions,
    formatter=argparse.RawDescriptionHelpFormatter,
)
