"""Each command's own flags, beside the RunConfig settings it takes: one small dataclass per
command, every field a `setting(...)` with its help, choices and default written once
(cli/flags.py makes the flags). A field without a group is listed under the command's
"options"; `positional` fields are its arguments."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from ..config import setting

AGENT = "torchrun's agent options (passed to torch's elastic agent as they are)"
PLAN_ONLY = "print the launch plan (nodes, ranks, master, backend, device) and start nothing"
CONFIG_HELP = (
    "read settings from a TOML, YAML or JSON file (keys as the flags or the field names; a run's "
    "config.json replays it); flags given here win over the file (--no-X turns a file's X off; "
    "--verbose wins over the file's quiet)"
)


def config_option() -> Any:
    """--config FILE: a command's settings from a file (config_file.py)."""
    return option(help=CONFIG_HELP, metavar="FILE")


def option(default: Any = None, help: str = "", *, group: str = "", **kwargs: Any) -> Any:
    """A setting of the command itself (by default in the "options" section of its --help)."""
    return setting(default, help, group=group, **kwargs)


@dataclass(frozen=True)
class TrainOptions:
    dry_run: bool = option(False, PLAN_ONLY)
    config: str | None = config_option()


@dataclass(frozen=True)
class LaunchOptions:
    dry_run: bool = option(False, PLAN_ONLY)
    config: str | None = config_option()
    module: bool = option(False, "run SCRIPT as a module (python -m SCRIPT)", flag="-m", aliases=("--module",))
    no_python: bool = option(
        False,
        "run SCRIPT as an executable itself, not through python (torchrun's --no-python)",
        aliases=("--no_python",),
    )
    run_path: bool = option(
        False,
        "run SCRIPT as a Python file path (torchrun's --run-path; what ddpkit does anyway)",
        aliases=("--run_path",),
    )
    # torchrun's flags for torch's elastic agent, passed on as they are (same spellings, types and
    # defaults as torch/distributed/run.py); None: torch's own default
    role: str | None = option(help="the workers' role name", group=AGENT)
    event_log_handler: str | None = option(
        help="torch's event log handler", group=AGENT, aliases=("--event_log_handler",)
    )
    signals_to_handle: str | None = option(
        help="signals the agent forwards to the workers (torch's default SIGTERM,SIGINT,SIGHUP,SIGQUIT)",
        group=AGENT,
        aliases=("--signals_to_handle",),
    )
    duplicate_stdout_filters: str | None = option(
        help="copy teed stdout lines matching any of these comma-separated filters to a file",
        group=AGENT,
        aliases=("--duplicate_stdout_filters",),
    )
    duplicate_stderr_filters: str | None = option(
        help="the same for stderr", group=AGENT, aliases=("--duplicate_stderr_filters",)
    )
    virtual_local_rank: bool = option(
        False, "every worker sees LOCAL_RANK=0 (and its own device)", group=AGENT, aliases=("--virtual_local_rank",)
    )
    shutdown_timeout: int | None = option(
        help="seconds the workers get to stop before SIGKILL (torch's default 30)",
        type=int,
        group=AGENT,
        aliases=("--shutdown_timeout",),
    )
    numa_binding: str | None = option(
        help="bind each worker to its GPU's NUMA node (torch's modes)", group=AGENT, aliases=("--numa_binding",)
    )
    logs_specs: str | None = option(
        help="a torchrun.logs_specs entry point instead of torch's DefaultLogsSpecs",
        group=AGENT,
        aliases=("--logs_specs",),
    )
    script: str | None = option(
        help="the script (or module with -m) to run in every worker", positional=True, nargs=None
    )
    args: list[str] | None = option(help="arguments passed to the script", positional=True, nargs=argparse.REMAINDER)


def agent_options(options: type = LaunchOptions) -> tuple[str, ...]:
    """The names of the settings ddpkit hands to torch's elastic agent unchanged."""
    return tuple(f.name for f in dataclasses.fields(options) if f.metadata["group"] == AGENT)


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


@dataclass(frozen=True)
class EnvOptions:
    json: bool = option(False, "print the report as JSON")


@dataclass(frozen=True)
class CheckOptions:
    json: bool = option(False, "print rank 0's report as JSON")
    config: str | None = config_option()


@dataclass(frozen=True)
class PlotOptions:
    run_dirs: list[str] | None = option(
        help="run directories of `ddpkit train`", positional=True, nargs="+", metavar="RUN_DIR"
    )
    out: str | None = option(
        help="the PNG to write",
        flag="-o",
        aliases=("--out",),
        default_help="RUN_DIR/curves.png for one run, ./curves.png for several",
    )
    label: list[str] | None = option(
        help="a legend label per run, in order", append=True, type=str, default_help="NAME (N processes)"
    )
    title: str | None = option(help="a title over the panels")


@dataclass(frozen=True)
class ExportOptions:
    run_dir: str | None = option(
        help="the run directory of `ddpkit train`", positional=True, nargs=None, metavar="RUN_DIR"
    )
    format: str = option(
        "safetensors",
        "safetensors: the weights as safetensors files; hf: a folder Hugging Face's from_pretrained loads "
        "(the weights and the model's config; a transformers model)",
        metavar="safetensors|hf",
    )
    out: str | None = option(help="the folder to write (must not exist, or be empty)", default_help="RUN_DIR/export")
    checkpoint: str | None = option(
        help="which weights: a checkpoint's name in RUN_DIR/checkpoints (epoch-000004), model.pt, or a path",
        metavar="NAME",
        default_help="the newest: the newest checkpoint, or model.pt when at least as new",
    )
    max_shard_size: str = option(
        "5GB", "above this size (500MB, 2GiB, ...) the weights are split into files and an index", metavar="SIZE"
    )


@dataclass(frozen=True)
class RunsOptions:
    folder: str = option(
        "runs", "the folder of run directories, or one run directory (default runs)", positional=True, metavar="DIR"
    )
    json: bool = option(False, "print every run's values as JSON")


@dataclass(frozen=True)
class BenchOptions:
    task: str = option("wine", "task for the step-time breakdown (default wine)", positional=True)
    nproc: str = option("1,2", "comma-separated process counts")
    what: str = option("allreduce,step", "allreduce, step, or both", default_help="both")
    sizes: str = option("4,1K,64K,1M,16M", "all-reduce message sizes in bytes, K/M/G suffixes")
    iters: int = option(50, "all-reduces per size, back to back")
    steps: int = option(20, "timed training steps per mode")
    json: str | None = option(help="also write the measurements as JSON", metavar="PATH")


@dataclass(frozen=True)
class VerifyOptions:
    steps: int = option(6, "optimizer steps each run trains and compares (the round trip resumes after half)")
