"""Command line: argument parsing only; every command calls the Python API."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from .. import config
from ..envvars import LAUNCH_TIME_VAR, REQUEUE_FILE_VAR, SLOW_EXIT_VAR
from ..errors import DdpkitError, Terminated
from .config_args import refuse_worker_placement, with_config_file
from .flags import OneLineParser, add_config_flags, add_option_flags, config_from, flag_defaults
from .options import (
    BenchOptions,
    CheckOptions,
    EnvOptions,
    ExportOptions,
    LaunchOptions,
    PlotOptions,
    RunsOptions,
    SlurmOptions,
    TrainOptions,
    VerifyOptions,
    agent_options,
)

ALL_GROUPS = (
    config.PROCESSES,
    config.NODES,
    config.TRAINING,
    config.FAULTS,
    config.OUTPUT,
    config.STRATEGY,
    config.PERFORMANCE,
)

TRAIN_HELP = """Train a task with DDP or FSDP (--strategy) over local worker processes (or as one worker, \
when started by
torchrun / srun). TASK is a built-in (wine, digits), MODULE:FUNCTION or path/to/file.py:FUNCTION;
the function returns ddpkit.Task(model=, train_set=, optimizer=, [eval_set=, loss_fn=, metric=])."""

LAUNCH_HELP = """Run any script on N local worker processes, with the environment torchrun gives
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...). In the script,
`rt = ddpkit.init()` joins the job; the same script runs unchanged under torchrun. Every torchrun
flag is accepted with torchrun's meaning (also with underscores: --nproc_per_node, --rdzv_conf, ...);
with several local workers every output line is whole and prefixed with its rank (--tee 3). Each
worker runs the script as python would (same argv, __file__, sys.path[0]) through a small ddpkit
bootstrap: --timeout becomes the default timeout of the script's process group, and a hang
(--hang-timeout) ends the job with every rank's Python stack and the rank that hung named."""


PLAN_HELP = """Print the memory plan of a task: per-rank bytes of parameters, gradients and optimizer
state under DDP and under FSDP at --nproc processes, and which strategy fits the device memory.
With --strategy hsdp also HSDP (--replicate R, default one replica per --nnodes); with --nnodes N
(--nproc per node) the bytes each rank sends between nodes per optimizer step. Beside them the
activations one micro-batch of --batch-size keeps for backward, with and without
--activation-checkpointing (one forward of the task's first samples on this CPU)."""

ENV_HELP = (
    "Print versions (Python, torch, CUDA, NCCL, gloo), devices and memory, the launcher environment (torchrun / "
    "SLURM / none) with the resolved ranks, the network interface and master address, what `ddpkit train` would "
    "do here, and warnings for known traps. Starts no process group."
)

CHECK_HELP = (
    "Start the workers `ddpkit train` would start with the same flags (or run as one under srun / torchrun: srun "
    "ddpkit check; every flag of train is accepted, the task and training flags are ignored) and check on every "
    "rank: a real all-reduce (latency and bandwidth, all ranks and every node pair), the backend and interface "
    "each rank chose, version parity (Python, torch, CUDA, NCCL, ddpkit), that the run directory is one shared "
    "folder, clocks, TCP ports between nodes, free memory and /dev/shm, known NCCL traps. One table and a "
    "verdict; exit 0 only when a job would run."
)

PLOT_HELP = (
    "Plot the metrics.jsonl of one or more run directories into one PNG: loss, the eval metric and samples/s per "
    "epoch, e.g. 1 vs 2 vs 4 processes."
)

EXPORT_HELP = (
    "Write a run's model as safetensors files, or as a folder Hugging Face's from_pretrained loads (--format hf: "
    "the weights, config.json and generation_config.json of a transformers model). Reads the run's newest "
    "checkpoint (one file, or FSDP's shards, read tensor by tensor: no process holds the whole model) or model.pt; "
    "above --max-shard-size the weights are split into files with an index, as Hugging Face does."
)

BENCH_HELP = (
    "Does DDP pay off here? All-reduce bus bandwidth and latency across message sizes (as nccl-tests reports "
    "them) and the task's step split into data, compute and communication, at each process count."
)

RUNS_HELP = (
    "List the runs in a folder (default runs/): task, world size, strategy, optimizer steps done/planned, the "
    "final train and eval loss, how the run ended (finished; stopped: by a --save-on-signal signal, with a "
    "checkpoint; interrupted: by Ctrl-C or a TERM without one; failed: with the error; running?: no end "
    "recorded, still running or killed without a word) and whether a "
    "checkpoint whose header loads is there to resume from."
)

VERIFY_HELP = (
    "Train the task for a few optimizer steps at one global batch G (= --nproc x --batch-size x --accumulate) "
    "as 1 x G, N x G/N and 1 x G/2 accumulating 2, checkpoint the N-process run part way and resume a copy, and "
    "compare the parameters after every step (in float64 where the task allows it; the model's nn.Dropout off, "
    "named). Prints the largest drift per parameter, the first step over the tolerance and the cause the evidence "
    "points to; exit 0 when the task is exact, 1 when it drifts, 3 when the training draws random numbers verify "
    "cannot turn off (turn them off and verify again), 2 for bad input. Takes every flag of train."
)


SLURM_HELP = """Write an sbatch script that runs `ddpkit train` on every node of a SLURM allocation:
one srun task per GPU (per worker on CPU nodes), each task one ddpkit worker that reads its
rank from SLURM, started through `srun --kill-on-bad-exit=1`. The job asks for a warning
signal before its time limit; ddpkit then checkpoints at the next step, requeues the job,
and the requeued job resumes. Example:

  ddpkit slurm --nodes 2 --gpus-per-node 8 --time 04:00:00 --submit -- wine --epochs 100
"""


def build_parser(file_settings: dict[str, Any] | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; `file_settings` (a --config file's) become the defaults of the flags,
    so a flag given on the command line wins over the file and a flag left out does not."""
    parser = OneLineParser(  # its subcommands' parsers too: a bad flag is one line, not the usage
        prog="ddpkit",
        description="Run a PyTorch training task on one process, every GPU of a node, or many nodes, with DDP, FSDP "
        "or HSDP.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in COMMANDS.items():
        p = sub.add_parser(
            name,
            help=command.help,
            description=command.description,
            formatter_class=command.formatter or argparse.HelpFormatter,
        )
        if command.groups or command.names:
            defaults = {**command.defaults, **flag_defaults(file_settings or {})}
            add_config_flags(p, command.groups, names=command.names, defaults=defaults)
        if command.options is not None:
            add_option_flags(p, command.options)
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, with a --config file read in between: parsed once to find the file,
    then again with the file's settings as the defaults. The file's settings that no flag of
    the command takes still reach its RunConfig (ns.file_settings, read by config_from)."""
    ns = build_parser().parse_args(argv)
    path = getattr(ns, "config", None)
    if not path:
        return ns
    from ..config_file import read_config_file

    settings = read_config_file(path)
    given = ns  # the command line alone: which switches it turned on
    ns = build_parser(settings).parse_args(argv)
    for pair in config.CONTRADICTIONS:
        for mine, theirs in (pair, pair[::-1]):
            if getattr(given, mine, None) is True and settings.get(theirs) is True and not getattr(given, theirs, None):
                setattr(ns, theirs, False)  # --verbose given over the file's quiet = true: the flag wins
    ns.file_settings = settings
    return ns


def cmd_train(ns: argparse.Namespace) -> int:
    if ns.save_on_signal and os.environ.get(REQUEUE_FILE_VAR) and "SLURM_STEP_ID" in os.environ:
        # a task of the script `ddpkit slurm` writes is the worker itself: a time-limit warning that
        # comes while torch loads must not kill it
        from ..training.signals import install_early

        install_early(ns.save_on_signal.split(","))
    from ..api import train

    train(config_from(ns), dry_run=ns.dry_run, _clean_parent=True)
    return 0


def cmd_launch(ns: argparse.Namespace) -> int:
    # The agent's store clients log every retry with a C++ stack (a static rendezvous whose node 0
    # never comes); ddpkit says what failed in one line. Quiet only in this process: the variable
    # is read once, when torch loads, and is gone before any worker starts (--verbose keeps them).
    quiet = not ns.verbose and "TORCH_CPP_LOG_LEVEL" not in os.environ and "torch" not in sys.modules
    if quiet:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        import torch  # noqa: F401
    finally:
        if quiet:
            del os.environ["TORCH_CPP_LOG_LEVEL"]
    from ..api import launch

    argv = (["-m", ns.script] if ns.module else [ns.script]) + list(ns.args)
    agent = {name: getattr(ns, name) for name in agent_options() if getattr(ns, name) not in (None, False)}
    return launch(argv, config_from(ns), dry_run=ns.dry_run, no_python=ns.no_python, agent_options=agent)


def cmd_slurm(ns: argparse.Namespace) -> int:
    import shlex
    from pathlib import Path

    from ..launchers import sbatch as slurm

    args = list(ns.train_args)
    if args[:1] == ["--"]:
        args = args[1:]
    args = with_config_file(args, ns.config)
    # Check the training arguments now, not in the job an hour later.
    try:
        train_ns = parse_args(["train", *args])
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


def cmd_env(ns: argparse.Namespace) -> int:
    import json

    from ..tools.doctor import collect, format_report

    report = collect(nproc=ns.nproc)
    print(json.dumps(report, indent=2) if ns.json else format_report(report))
    return 0


def cmd_verify(ns: argparse.Namespace) -> int:
    from ..tools.verify import verify

    report = verify(config_from(ns), steps=ns.steps, _clean_parent=True)
    print(report["text"], flush=True)
    return report["exit_code"]


def cmd_check(ns: argparse.Namespace) -> int:
    from ..tools.check import main_check

    return main_check(config_from(ns), ns.json)


def cmd_plot(ns: argparse.Namespace) -> int:
    from ..reporting.plot import plot_runs

    print(f"wrote {plot_runs(ns.run_dirs, ns.out, ns.label, ns.title)}")
    return 0


def cmd_runs(ns: argparse.Namespace) -> int:
    from ..tools.runs import main_runs

    return main_runs(ns.folder, ns.json)


def cmd_plan(ns: argparse.Namespace) -> int:
    from ..api import memory_plan

    nnodes = int(str(ns.nnodes).rpartition(":")[2] or 1)  # an elastic MIN:MAX: plan for MAX
    print(
        memory_plan(
            ns.task,
            nproc=ns.nproc * nnodes if ns.nproc else ns.nproc,
            strategy=ns.strategy,
            precision=ns.precision,
            device_memory=ns.device_memory,
            task_args=dict(ns.task_args or ()),
            local_nproc=ns.nproc,
            replicate=ns.replicate,
            nnodes=nnodes,
            batch_size=ns.batch_size,
            activation_checkpointing=ns.activation_checkpointing,
        ).format(ns.task, ns.strategy),
        flush=True,
    )
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    from ..checkpoint.export import export_run

    export_run(
        ns.run_dir, ns.format, ns.out, ns.checkpoint, ns.max_shard_size, say=lambda line: print(line, flush=True)
    )
    return 0


def cmd_bench(ns: argparse.Namespace) -> int:
    from ..tools.bench import main_bench

    return main_bench(ns)


@dataclass(frozen=True)
class Command:
    """A command of the CLI: what it does, the RunConfig settings it takes (whole groups or
    single fields, `defaults` for its own defaults of them) and its own options."""

    run: Callable[[argparse.Namespace], int]
    help: str
    description: str
    groups: tuple[str, ...] = ()
    names: tuple[str, ...] = ()
    defaults: dict[str, Any] = field(default_factory=dict)
    options: type | None = None
    formatter: type[argparse.HelpFormatter] | None = None


COMMANDS = {
    "train": Command(
        cmd_train,
        "train a task (default: the guide's Wine task)",
        TRAIN_HELP,
        ALL_GROUPS,
        ("task",),
        options=TrainOptions,
    ),
    "plan": Command(
        cmd_plan,
        "memory per rank under DDP and FSDP, and which one fits",
        PLAN_HELP,
        (config.STRATEGY,),
        ("task", "nproc", "task_args", "nnodes", "batch_size"),
        defaults={"strategy": "auto"},
    ),
    "launch": Command(
        cmd_launch,
        "run any script on N local workers (like torchrun)",
        LAUNCH_HELP,
        (config.PROCESSES, config.NODES),
        ("hang_timeout",),
        options=LaunchOptions,
    ),
    "slurm": Command(
        cmd_slurm,
        "write (and submit) an sbatch script that runs `ddpkit train` on N nodes",
        SLURM_HELP,
        options=SlurmOptions,
        formatter=argparse.RawDescriptionHelpFormatter,
    ),
    "env": Command(
        cmd_env,
        "what a bug report needs: versions, devices, launcher, network, and known traps",
        ENV_HELP,
        names=("nproc",),
        options=EnvOptions,
    ),
    # the flags of train: paste a train command, say check
    "check": Command(
        cmd_check,
        "pre-flight: would a job run on this node / allocation? (all-reduce, versions, shared run "
        "directory, clocks, ports, memory, NCCL traps)",
        CHECK_HELP,
        ALL_GROUPS,
        ("task",),
        options=CheckOptions,
    ),
    # the flags of train: paste a train command, say verify
    "verify": Command(
        cmd_verify,
        "is a task exact at any world size? compare its parameters step by step at 1 and N processes",
        VERIFY_HELP,
        ALL_GROUPS,
        ("task",),
        options=VerifyOptions,
    ),
    "plot": Command(
        cmd_plot, "PNG curves of runs (loss, eval accuracy, samples/s), side by side", PLOT_HELP, options=PlotOptions
    ),
    "export": Command(
        cmd_export,
        "write a run's model as safetensors, or a Hugging Face folder (from_pretrained)",
        EXPORT_HELP,
        options=ExportOptions,
    ),
    "runs": Command(
        cmd_runs,
        "one line per run in a folder: task, world size, steps, losses, how it ended, resumable",
        RUNS_HELP,
        options=RunsOptions,
    ),
    "bench": Command(
        cmd_bench,
        "measure all-reduce bandwidth/latency and a task's step time at 1..N processes",
        BENCH_HELP,
        names=("batch_size", "threads", "backend", "grad_sync", "device", "timeout"),
        options=BenchOptions,
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    """The command's exit code, by the shell's convention: 0 done, 1 a failure (a worker's crash,
    a hang), 2 a usage error (a refusal of ddpkit's, one line), 128 + N after signal N (130 for
    Ctrl-C's SIGINT, 143 for SIGTERM)."""
    os.environ.setdefault(LAUNCH_TIME_VAR, repr(time.time()))
    with terminated_as_interrupt(argv is None):
        parser = build_parser()
        ns = parser.parse_args(argv)
        if ns.command is None:
            parser.print_help()
            return 2
        try:
            if getattr(ns, "config", None):
                ns = parse_args(argv)
            code = COMMANDS[ns.command].run(ns)
        except DdpkitError as e:
            print(f"ddpkit: error: {e}", file=sys.stderr, flush=True)
            code = getattr(e, "exit_code", 2)
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated) before a launch handles signals
            signum = getattr(e, "signum", signal.SIGINT)
            print(f"ddpkit: stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
            code = 128 + signum
    if argv is None and ns.command in ("train", "bench", "check", "verify") and not os.environ.get(SLOW_EXIT_VAR):
        quick_exit(code)
    return code


@contextlib.contextmanager
def terminated_as_interrupt(install: bool) -> Iterator[None]:
    """SIGTERM raises Terminated (a KeyboardInterrupt) in the command line's own process: it
    unwinds as Ctrl-C does, so that a TERM in the first seconds (while torch loads, before a
    launch handles signals) leaves nothing half made and says so, instead of ending the process
    where it stands. Only for the real command line (`install`), never in a caller's process."""
    if not install or threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum: int, frame: Any) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def quick_exit(code: int) -> None:
    """End the command-line process now: the work is done, the workers are gone and
    everything is written. The interpreter's own teardown of torch takes ~1 s more (measured)
    and does nothing a finished run needs. Only for the real CLI (argv from the command
    line), never when main() is called from Python; DDPKIT_SLOW_EXIT=1 turns it off."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
