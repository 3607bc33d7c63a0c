"""`ddpkit slurm`'s decisions: which training arguments go into the job (SLURM places the
workers, so no flag or config-file setting that says where they run; a config file travels by
its absolute path), the job's run directory and script, and writing, submitting and following
it. sbatch.py renders the script and talks to SLURM; the CLI (cli/slurm_cmd.py) only parses."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ..config.file import FIELDS
from ..config.launch import LaunchTable
from ..config.settings import flag_spellings
from ..errors import DdpkitError
from ..util.jobtoken import ensure_token_file
from . import sbatch
from .job import check_run_dir_shared, job_description, run_dir_of

# The settings that say where the workers run: SLURM's, never the job's training arguments'
# (in the order the flags are refused: the first one given is named)
SLURM_PLACES = ("nproc", "nnodes", "node_rank", "master_addr", "rdzv_endpoint", "master_port")


def placement_flags() -> tuple[str, ...]:
    """Every spelling of the flags of SLURM_PLACES (--nproc, --nproc-per-node, --node_rank, ...)."""
    return tuple(flag for name in SLURM_PLACES for flag in flag_spellings(FIELDS[name]))


def slurm_command(
    opts: Any,
    command_line: str,
    parse_train: Callable[[list[str]], Any],
    train_config: Callable[[Any], Any],
) -> int:
    """`ddpkit slurm` with its options `opts` (the fields of cli/slurm_cmd.py's SlurmOptions).
    `parse_train` parses the arguments of `ddpkit train` (a SystemExit: they are not valid),
    `train_config` makes their RunConfig (checking the values); `command_line` heads the script.
    The exit code: 0, or with --wait the job's exit status."""
    args, train = train_arguments(opts.train_args, opts.config, parse_train)
    config = train_config(train)  # validates values
    job = slurm_job_description(opts, args)
    check_exclude_slow(job, config)
    name = job.job_name or "ddpkit"
    chosen = run_dir_of(job, train.run_dir)
    run_dir = Path(chosen or f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if not train.run_dir:
        args += ["--run-dir", str(run_dir)]
    check_run_dir_shared(run_dir, job, "SLURM", dry_run=opts.dry_run)
    slurm = sbatch.SlurmJob(
        train_args=args,
        nodes=job.nodes or 1,
        gpus_per_node=job.gpus_per_node or 0,
        tasks_per_node=job.workers_per_node,
        cpus_per_task=job.cpus_per_worker,
        memory=job.memory,
        time=job.time,
        partition=job.partition,
        account=job.account,
        job_name=name,
        output=opts.output,
        signal=opts.signal,
        run_dir=str(run_dir),
        array=opts.array,
        exclude_slow=bool(job.exclude_slow),
    )
    if opts.array and opts.wait:
        raise DdpkitError("--wait follows one job, not an array: follow its elements with squeue")
    text = sbatch.render_sbatch(slurm, command_line)
    check_placeable(slurm, opts.dry_run)
    if opts.dry_run:
        print(text, end="")
        return 0
    script = _write_script(Path(opts.script) if opts.script else run_dir / "job.sbatch", text, run_dir)
    if not opts.submit:
        print(f"ddpkit: wrote {script}; submit it with: sbatch {shlex.quote(str(script))}")
        return 0
    job_id = sbatch.submit(script)
    log = (opts.output or str(run_dir / "slurm-%j.out")).replace("%j", job_id)
    print(f"ddpkit: submitted job {job_id}; log: {log}", flush=True)
    if not opts.wait:
        return 0
    code = sbatch.wait(job_id, timeout=opts.wait_timeout, report=lambda m: print(m, flush=True))
    print(f"ddpkit: job {job_id} ended with exit status {code}; log: {log}", flush=True)
    return code


def _write_script(script: Path, text: str, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)  # SLURM cannot create the log file's folder
    ensure_token_file(run_dir)  # the script names it; a job written again keeps its token
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(text)
    script.chmod(0o755)
    return script


def check_placeable(job: sbatch.SlurmJob, dry_run: bool) -> None:
    """A job this cluster could never run (no such partition, too many nodes, too long) is
    refused before it is submitted; a dry run (perhaps written away from the cluster) warns."""
    problem = sbatch.check_against(job, sbatch.partitions())
    if problem and dry_run:
        print(f"ddpkit: warning: {problem}", file=sys.stderr, flush=True)
    elif problem:
        raise DdpkitError(problem)


def slurm_job_description(opts: Any, args: list[str]) -> LaunchTable:
    """The job: the config file's [launch] table (the file of --config, before or after --)
    under `ddpkit slurm`'s own flags."""
    return job_description(
        config_of(args),
        nodes=opts.nodes,
        gpus_per_node=opts.gpus_per_node,
        workers_per_node=opts.ntasks_per_node,
        cpus_per_worker=opts.cpus_per_task,
        memory=opts.mem,
        time=opts.time,
        partition=opts.partition,
        account=opts.account,
        job_name=opts.job_name,
        shared_run_dir=opts.shared_run_dir or None,
        exclude_slow=opts.exclude_slow or None,
    )


def check_exclude_slow(job: LaunchTable, config: Any) -> None:
    """--exclude-slow acts on what the straggler view names, check by check: it needs the checks."""
    if job.exclude_slow and not getattr(config, "straggler_every", 1):
        raise DdpkitError(
            "--exclude-slow (exclude_slow in [launch]) leaves out the nodes the straggler checks name, but "
            "--straggler-every is 0: give it a number of steps after -- (e.g. --straggler-every 100)"
        )


def config_of(args: list[str]) -> str | None:
    """The config file the training arguments name (--config FILE or --config=FILE), if any."""
    for i, a in enumerate(args):
        if a == "--config" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--config="):
            return a.partition("=")[2]
    return None


SLURM_USE = "--nodes / --gpus-per-node / --ntasks-per-node of `ddpkit slurm`"


def train_arguments(
    train_args: list[str] | None,
    config: str | None,
    parse_train: Callable[[list[str]], Any],
    engine: str = "SLURM",
    use: str = SLURM_USE,
) -> tuple[list[str], Any]:
    """The arguments of `ddpkit train` the job runs (after --; a config file by its absolute
    path) and what `parse_train` made of them: checked now, not in the job an hour later. No
    placement flag: `engine` starts the workers (`use`: the engine command's flags that say it)."""
    args = list(train_args or ())
    args = with_config_file(args, config)
    try:
        train = parse_train(args)
    except SystemExit:
        raise DdpkitError(
            "the arguments after -- are not valid `ddpkit train` arguments (see the message above)"
        ) from None
    for flag in placement_flags():
        if any(a == flag or a.startswith(flag + "=") for a in args):
            raise DdpkitError(f"{flag} does not belong after --: {engine} starts the workers (use {use})")
    refuse_worker_placement(getattr(train, "file_settings", {}), train.config, engine, use)
    return args, train


def with_config_file(args: list[str], config: str | None) -> list[str]:
    """The training arguments with the config file (ddpkit slurm's --config or one after --)
    named by its absolute path: the job reads it where it starts."""
    out = list(args)
    for i, a in enumerate(out):
        if a == "--config" and i + 1 < len(out):
            out[i + 1] = str(Path(out[i + 1]).resolve())
        elif a.startswith("--config="):
            out[i] = "--config=" + str(Path(a.partition("=")[2]).resolve())
    if config:
        if any(a == "--config" or a.startswith("--config=") for a in args):
            raise DdpkitError("--config given both before and after --: keep one")
        out = ["--config", str(Path(config).resolve()), *out]
    return out


def refuse_worker_placement(
    settings: dict[str, Any], path: str | None, engine: str = "SLURM", use: str = SLURM_USE
) -> None:
    """Where the workers run is the engine's, as for the flags after --: a config file may not say it."""
    for name, value in settings.items():
        if name in SLURM_PLACES and value != FIELDS[name].default:
            raise DdpkitError(
                f"{name} = {value!r} in {path} does not belong in a {engine} job: {engine} starts the "
                f"workers (remove it; use {use})"
            )
