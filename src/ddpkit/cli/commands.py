"""Command line: argument parsing only; every command calls the Python API."""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Sequence

from .. import config
from ..config import LAUNCH_TIME_VAR
from ..errors import DdpkitError, WorkerFailed
from .flags import add_config_flags, config_from

ALL_GROUPS = (config.PROCESSES, config.NODES, config.TRAINING, config.FAULTS, config.OUTPUT, config.STRATEGY, config.PERFORMANCE)

TRAIN_HELP = """Train a task with DDP or FSDP (--strategy) over local worker processes (or as one worker, when started by
torchrun / srun). TASK is a built-in (wine, digits), MODULE:FUNCTION or path/to/file.py:FUNCTION;
the function returns ddpkit.Task(model=, train_set=, optimizer=, [eval_set=, loss_fn=, metric=])."""

LAUNCH_HELP = """Run any script on N local worker processes, with the environment torchrun gives
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...). In the script,
`rt = ddpkit.init()` joins the job; the same script runs unchanged under torchrun. Every torchrun
flag is accepted with torchrun's meaning (also with underscores: --nproc_per_node, --rdzv_conf, ...);
with several local workers every output line is whole and prefixed with its rank (--tee 3)."""


PLAN_HELP = """Print the memory plan of a task: per-rank bytes of parameters, gradients and optimizer
state under DDP and under FSDP at --nproc processes, and which strategy fits the device memory."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpkit",
        description="Run a PyTorch training task on one process, every GPU of a node, or many nodes, with DDP or FSDP "
                    "(HSDP is coming).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    t = sub.add_parser("train", help="train a task (default: the guide's Wine task)", description=TRAIN_HELP)
    add_config_flags(t, ALL_GROUPS, names=("task",))
    _add_dry_run(t)

    pl = sub.add_parser("plan", help="memory per rank under DDP and FSDP, and which one fits", description=PLAN_HELP)
    add_config_flags(pl, [config.STRATEGY], names=("task", "nproc", "task_args"), defaults={"strategy": "auto"})

    la = sub.add_parser("launch", help="run any script on N local workers (like torchrun)", description=LAUNCH_HELP)
    add_config_flags(la, [config.PROCESSES, config.NODES])
    _add_dry_run(la)
    la.add_argument("-m", "--module", dest="module", action="store_true", help="run SCRIPT as a module (python -m SCRIPT)")
    la.add_argument("--no-python", "--no_python", dest="no_python", action="store_true",
                    help="run SCRIPT as an executable itself, not through python (torchrun's --no-python)")
    la.add_argument("--run-path", "--run_path", dest="run_path", action="store_true",
                    help="run SCRIPT as a Python file path (torchrun's --run-path; what ddpkit does anyway)")
    _add_agent_options(la)
    la.add_argument("script", help="the script (or module with -m) to run in every worker")
    la.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    s = sub.add_parser("slurm", help="write (and submit) an sbatch script that runs `ddpkit train` on N nodes",
                       description=SLURM_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--nodes", type=int, default=1, help="nodes to ask for (default 1)")
    s.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node; one task (worker) per GPU (default 0: CPU nodes)")
    s.add_argument("--ntasks-per-node", type=int, default=None, help="workers per node on CPU nodes (default: GPUs per node, or 1)")
    s.add_argument("--cpus-per-task", type=int, default=None, help="CPU cores per worker")
    s.add_argument("--time", default=None, help="time limit, e.g. 02:00:00")
    s.add_argument("--partition", default=None)
    s.add_argument("--account", default=None)
    s.add_argument("--job-name", default="ddpkit")
    s.add_argument("--output", default=None, help="log file pattern (default RUN_DIR/slurm-%%j.out)")
    s.add_argument("--signal", default="USR2@90", help="warning signal before the time limit: save, requeue, resume "
                   "(default USR2@90, not USR1, which NCCL and other libraries may handle; '' = none)")
    s.add_argument("--script", default=None, help="where to write the script (default RUN_DIR/job.sbatch)")
    s.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")
    s.add_argument("--submit", action="store_true", help="submit it with sbatch; print the job id and log path")
    s.add_argument("--wait", action="store_true", help="with --submit: follow the job (through requeues) to its end and exit with its status")
    s.add_argument("--wait-timeout", type=float, default=None, help="give up waiting after this many seconds (the job keeps running)")
    s.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then the arguments of `ddpkit train` (task and flags)")

    ev = sub.add_parser("env", help="what a bug report needs: versions, devices, launcher, network, and known traps",
                        description="Print versions (Python, torch, CUDA, NCCL, gloo), devices and memory, the launcher "
                                    "environment (torchrun / SLURM / none) with the resolved ranks, the network interface "
                                    "and master address, what `ddpkit train` would do here, and warnings for known traps. "
                                    "Starts no process group.")
    add_config_flags(ev, names=("nproc",))
    ev.add_argument("--json", action="store_true", help="print the report as JSON")

    ck = sub.add_parser("check", help="pre-flight: would a job run on this node / allocation? (all-reduce, versions, "
                                      "shared run directory, clocks, ports, memory, NCCL traps)",
                        description="Start the workers `ddpkit train` would start with the same flags (or run as one under "
                                    "srun / torchrun: srun ddpkit check; every flag of train is accepted, the task and training flags are "
                                    "ignored) and check on every rank: a real all-reduce (latency "
                                    "and bandwidth, all ranks and every node pair), the backend and interface each rank chose, "
                                    "version parity (Python, torch, CUDA, NCCL, ddpkit), that the run directory is one shared "
                                    "folder, clocks, TCP ports between nodes, free memory and /dev/shm, known NCCL traps. "
                                    "One table and a verdict; exit 0 only when a job would run.")
    add_config_flags(ck, ALL_GROUPS, names=("task",))  # the flags of train: paste a train command, say check
    ck.add_argument("--json", action="store_true", help="print rank 0's report as JSON")

    pl = sub.add_parser("plot", help="PNG curves of runs (loss, eval accuracy, samples/s), side by side",
                        description="Plot the metrics.jsonl of one or more run directories into one PNG: "
                                    "loss, the eval metric and samples/s per epoch, e.g. 1 vs 2 vs 4 processes.")
    pl.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories of `ddpkit train`")
    pl.add_argument("-o", "--out", default=None, help="the PNG to write (default: RUN_DIR/curves.png for one run, ./curves.png for several)")
    pl.add_argument("--label", action="append", default=None, help="a legend label per run, in order (default: NAME (N processes))")
    pl.add_argument("--title", default=None, help="a title over the panels")

    b = sub.add_parser("bench", help="measure all-reduce bandwidth/latency and a task's step time at 1..N processes",
                       description="Does DDP pay off here? All-reduce bus bandwidth and latency across message sizes "
                                   "(as nccl-tests reports them) and the task's step split into data, compute and "
                                   "communication, at each process count.")
    b.add_argument("task", nargs="?", default="wine", help="task for the step-time breakdown (default wine)")
    b.add_argument("--nproc", default="1,2", help="comma-separated process counts (default 1,2)")
    b.add_argument("--what", default="allreduce,step", help="allreduce, step, or both (default)")
    b.add_argument("--sizes", default="4,1K,64K,1M,16M", help="all-reduce message sizes in bytes, K/M/G suffixes (default 4,1K,64K,1M,16M)")
    b.add_argument("--iters", type=int, default=50, help="all-reduces per size, back to back (default 50)")
    b.add_argument("--steps", type=int, default=20, help="timed training steps per mode (default 20)")
    add_config_flags(b, names=("batch_size", "threads", "backend", "grad_sync", "device", "timeout"))
    b.add_argument("--json", default=None, metavar="PATH", help="also write the measurements as JSON")
    return parser


SLURM_HELP = """Write an sbatch script that runs `ddpkit train` on every node of a SLURM allocation:
one srun task per GPU (per worker on CPU nodes), each task one ddpkit worker that reads its
rank from SLURM, started through `srun --kill-on-bad-exit=1`. The job asks for a warning
signal before its time limit; ddpkit then checkpoints at the next step, requeues the job,
and the requeued job resumes. Example:

  ddpkit slurm --nodes 2 --gpus-per-node 8 --time 04:00:00 --submit -- wine --epochs 100
"""


# torchrun's flags for torch's elastic agent that ddpkit passes on as they are (same spellings,
# types and defaults as torch/distributed/run.py); name: (spellings, argparse keywords)
AGENT_OPTIONS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "role": (("--role",), {"help": "the workers' role name"}),
    "event_log_handler": (("--event-log-handler", "--event_log_handler"), {"help": "torch's event log handler"}),
    "signals_to_handle": (("--signals-to-handle", "--signals_to_handle"),
                          {"help": "signals the agent forwards to the workers (torch's default SIGTERM,SIGINT,SIGHUP,SIGQUIT)"}),
    "duplicate_stdout_filters": (("--duplicate-stdout-filters", "--duplicate_stdout_filters"),
                                 {"help": "copy teed stdout lines matching any of these comma-separated filters to a file"}),
    "duplicate_stderr_filters": (("--duplicate-stderr-filters", "--duplicate_stderr_filters"), {"help": "the same for stderr"}),
    "virtual_local_rank": (("--virtual-local-rank", "--virtual_local_rank"),
                           {"action": "store_true", "help": "every worker sees LOCAL_RANK=0 (and its own device)"}),
    "shutdown_timeout": (("--shutdown-timeout", "--shutdown_timeout"),
                         {"type": int, "help": "seconds the workers get to stop before SIGKILL (torch's default 30)"}),
    "numa_binding": (("--numa-binding", "--numa_binding"), {"help": "bind each worker to its GPU's NUMA node (torch's modes)"}),
    "logs_specs": (("--logs-specs", "--logs_specs"), {"help": "a torchrun.logs_specs entry point instead of torch's DefaultLogsSpecs"}),
}


def _add_agent_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("torchrun's agent options (passed to torch's elastic agent as they are)")
    for name, (spellings, kwargs) in AGENT_OPTIONS.items():
        g.add_argument(*spellings, dest=name, default=None, **kwargs)


def train_config(ns: argparse.Namespace) -> Any:
    return config_from(ns)


def _add_dry_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="print the launch plan (nodes, ranks, master, backend, device) and start nothing")


def cmd_train(ns: argparse.Namespace) -> int:
    from ..api import train

    train(train_config(ns), dry_run=ns.dry_run, _clean_parent=True)
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
    agent = {name: getattr(ns, name) for name in AGENT_OPTIONS if getattr(ns, name) not in (None, False)}
    try:
        return launch(argv, config_from(ns), dry_run=ns.dry_run, no_python=ns.no_python, agent_options=agent)
    except WorkerFailed as e:  # the script failed, not ddpkit's input: torchrun's exit code, where CI looks
        print(f"ddpkit: error: {e}", file=sys.stderr, flush=True)
        return e.exit_code


def cmd_slurm(ns: argparse.Namespace) -> int:
    import shlex
    from pathlib import Path

    from ..launchers import sbatch as slurm

    args = list(ns.train_args)
    if args[:1] == ["--"]:
        args = args[1:]
    # Check the training arguments now, not in the job an hour later.
    try:
        train_ns = build_parser().parse_args(["train", *args])
    except SystemExit:
        raise DdpkitError("the arguments after -- are not valid `ddpkit train` arguments (see the message above)") from None
    for flag in ("--nproc", "--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--rdzv-endpoint", "--master-port"):
        if any(a == flag or a.startswith(flag + "=") for a in args):
            raise DdpkitError(f"{flag} does not belong after --: SLURM starts the workers "
                              "(use --nodes / --gpus-per-node / --ntasks-per-node of `ddpkit slurm`)")
    train_config(train_ns)  # validates values
    run_dir = Path(train_ns.run_dir or f"runs/{ns.job_name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if not train_ns.run_dir:
        args += ["--run-dir", str(run_dir)]
    job = slurm.SlurmJob(train_args=args, nodes=ns.nodes, gpus_per_node=ns.gpus_per_node, tasks_per_node=ns.ntasks_per_node,
                         cpus_per_task=ns.cpus_per_task, time=ns.time, partition=ns.partition, account=ns.account,
                         job_name=ns.job_name, output=ns.output, signal=ns.signal, run_dir=str(run_dir))
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


def cmd_check(ns: argparse.Namespace) -> int:
    from ..tools.check import main_check

    return main_check(config_from(ns), ns.json)


def cmd_plot(ns: argparse.Namespace) -> int:
    from ..reporting.plot import plot_runs

    print(f"wrote {plot_runs(ns.run_dirs, ns.out, ns.label, ns.title)}")
    return 0

def cmd_plan(ns: argparse.Namespace) -> int:
    from ..api import memory_plan

    print(memory_plan(ns.task, nproc=ns.nproc, strategy=ns.strategy, precision=ns.precision, device_memory=ns.device_memory,
                      task_args=dict(ns.task_args or ())).format(ns.task, ns.strategy), flush=True)
    return 0


def cmd_bench(ns: argparse.Namespace) -> int:
    from ..tools.bench import main_bench

    return main_bench(ns)


COMMANDS = {"train": cmd_train, "launch": cmd_launch, "slurm": cmd_slurm, "plan": cmd_plan, "env": cmd_env,
            "plot": cmd_plot, "bench": cmd_bench, "check": cmd_check}


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault(LAUNCH_TIME_VAR, repr(time.time()))
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command is None:
        parser.print_help()
        return 2
    try:
        code = COMMANDS[ns.command](ns)
    except DdpkitError as e:
        print(f"ddpkit: error: {e}", file=sys.stderr, flush=True)
        code = 2
    except KeyboardInterrupt:
        print("ddpkit: interrupted", file=sys.stderr, flush=True)
        code = 130
    if argv is None and ns.command in ("train", "bench", "check") and not os.environ.get("DDPKIT_SLOW_EXIT"):
        quick_exit(code)
    return code


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
