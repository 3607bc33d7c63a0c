"""Command line: argument parsing only; every command calls the Python API."""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Sequence

from .config import GRAD_SYNC_MODES, LAUNCH_TIME_VAR
from .errors import DdpkitError

TRAIN_HELP = """Train a task with DDP over local worker processes (or as one worker, when started by
torchrun / srun). TASK is a built-in (wine, digits), MODULE:FUNCTION or path/to/file.py:FUNCTION;
the function returns ddpkit.Task(model=, train_set=, optimizer=, [eval_set=, loss_fn=, metric=])."""

LAUNCH_HELP = """Run any script on N local worker processes, with the environment torchrun gives
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...). In the script,
`rt = ddpkit.init()` joins the job; the same script runs unchanged under torchrun."""


def _nproc(value: str) -> int | None:
    if value == "auto":
        return None
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer or 'auto', got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or 'auto', got {value!r}")
    return n


def _add_process_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("processes")
    g.add_argument("--nproc", "--nproc-per-node", dest="nproc", type=_nproc, default=None, metavar="N|auto",
                   help="worker processes on this node (default auto: one per GPU; 2 on a machine without GPUs)")
    g.add_argument("--max-restarts", type=int, default=0, help="restart all workers this many times after a failure; they resume from the newest checkpoint (default 0)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads per process (default: cores / processes)")
    g.add_argument("--start-method", choices=("auto", "fork", "spawn"), default="auto",
                   help="how workers are created: fork (fast, CPU only) or spawn (default auto: fork on CPU, spawn with GPUs)")
    g.add_argument("--timeout", type=float, default=300.0,
                   help="seconds any collective or rendezvous may wait before the job fails instead of hanging (default 300)")
    g.add_argument("--dry-run", action="store_true", help="print the launch plan (nodes, ranks, master, backend, device) and start nothing")
    g.add_argument("--debug-collectives", action="store_true", help="check across ranks that every collective matches (op, shapes, order) and name the rank that diverged (slow)")
    g.add_argument("--verbose", action="store_true", help="show the elastic agent's own logs (rendezvous, restarts, failures)")
    n = p.add_argument_group("several nodes (run the same command on every node)")
    n.add_argument("--nnodes", default="1", help="number of nodes, or MIN:MAX for an elastic job with --rdzv-endpoint (default 1)")
    n.add_argument("--node-rank", type=int, default=None, help="this node's index, 0 on the master node (static rendezvous with --master-addr)")
    n.add_argument("--master-addr", default=None, help="address of node 0 (static rendezvous)")
    n.add_argument("--master-port", type=int, default=None, help="port on node 0 for the static rendezvous (default 29500)")
    n.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="c10d rendezvous: every node names the same HOST:PORT (hosted by the node that owns HOST); node ranks are assigned, no --node-rank")
    n.add_argument("--rdzv-id", default=None, help="job id shared by all nodes of a c10d rendezvous (default: random; give one for several nodes)")
    n.add_argument("--local-addr", default=None, help="this node's address as the other nodes reach it (default: the address that routes to the master)")


def _add_perf_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("performance (see README: Performance)")
    g.add_argument("--accumulate", type=int, default=1, metavar="K",
                   help="K micro-batches of --batch-size per optimizer step, gradients all-reduced once (no_sync on the others); equals --batch-size K*b (default 1)")
    g.add_argument("--grad-compression", choices=("none", "bf16", "fp16", "powersgd"), default="none",
                   help="all-reduce gradients in 16 bits, or low-rank PowerSGD: less traffic, close but not equal results (default none)")
    g.add_argument("--grad-sync", choices=GRAD_SYNC_MODES, default="auto",
                   help="how gradients are all-reduced: shm (shared memory, ranks on one machine's CPUs), backend (gloo/NCCL), "
                        "auto: shm where it applies (CPU, one node), else the backend (default auto)")
    g.add_argument("--bucket-mb", type=float, default=None, help="DDP gradient bucket size in MB (default: torch's 25)")
    g.add_argument("--static-graph", action="store_true", help="tell DDP the model uses the same parameters every step (skips per-step graph checks)")
    g.add_argument("--fused-optimizer", choices=("off", "on", "auto"), default="off",
                   help="rebuild torch Adam/AdamW/SGD with fused=True (one kernel over all parameters); auto: on with GPUs (default off)")
    g.add_argument("--compile", action="store_true", help="torch.compile the model (slow first steps; needs a C++ compiler on CPU)")


def _perf_config(ns: argparse.Namespace) -> dict[str, Any]:
    return dict(accumulate=ns.accumulate, grad_compression=ns.grad_compression, grad_sync=ns.grad_sync, bucket_mb=ns.bucket_mb,
                static_graph=ns.static_graph, fused_optimizer=ns.fused_optimizer, compile=ns.compile)


def _process_config(ns: argparse.Namespace) -> dict[str, Any]:
    return dict(nproc=ns.nproc, max_restarts=ns.max_restarts, threads=ns.threads, start_method=ns.start_method,
                timeout=ns.timeout, verbose=ns.verbose, debug_collectives=ns.debug_collectives, nnodes=ns.nnodes, node_rank=ns.node_rank,
                master_addr=ns.master_addr, master_port=ns.master_port, rdzv_endpoint=ns.rdzv_endpoint,
                rdzv_id=ns.rdzv_id, local_addr=ns.local_addr)


def _add_strategy_flags(p: argparse.ArgumentParser, default: str) -> None:
    """DDP or FSDP, precision, device memory: shared by `train` and `plan`."""
    p.add_argument("--strategy", choices=("ddp", "fsdp", "auto"), default=default,
                   help="ddp: a whole replica per process (fastest); fsdp: shard parameters, gradients and optimizer "
                        f"state across processes (for models that do not fit); auto: the memory plan picks (default {default})")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: autocast (DDP) or bf16 compute with fp32 weights (FSDP); needs a GPU or CPU with bf16 (default fp32)")
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="memory per device for the plan and --strategy auto: 80GiB (2^30 bytes), 80GB (10^9), 512MB (default: detected)")


PLAN_HELP = """Print the memory plan of a task: per-rank bytes of parameters, gradients and optimizer
state under DDP and under FSDP at --nproc processes, and which strategy fits the device memory."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpkit",
        description="Run a PyTorch training task on one process, every GPU of a node, or many nodes, with DDP.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    t = sub.add_parser("train", help="train a task (default: the guide's Wine task)", description=TRAIN_HELP)
    t.add_argument("task", nargs="?", default="wine", help="wine (default), digits, MODULE:FUNCTION or FILE.py:FUNCTION")
    _add_process_flags(t)
    t.add_argument("--epochs", type=int, default=100, help="epochs to train (default 100)")
    t.add_argument("--batch-size", type=int, default=32, help="batch size PER PROCESS, as in the guide; the global batch is nproc x this (default 32)")
    t.add_argument("--lr", type=float, default=None, help="learning rate (default: the task's own; Wine: 1e-3)")
    t.add_argument("--seed", type=int, default=0, help="seed for the model and the sample order; same seed = same result at any --nproc (default 0)")
    t.add_argument("--no-shuffle", dest="shuffle", action="store_false", help="train in data-set order")
    t.add_argument("--save-every", type=int, default=50, help="write a full checkpoint every N epochs, and at the end; 0 = final model only (default 50)")
    t.add_argument("--eval-every", type=int, default=1, help="evaluate the held-out split every N epochs (default 1)")
    t.add_argument("--run-dir", default=None, help="where model.pt, metrics.jsonl and checkpoints/ go (default runs/TASK-TIME)")
    t.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint in --run-dir")
    t.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto", help="process-group backend (default auto: nccl with GPUs, gloo on CPU)")
    t.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="device (default auto: cuda when a GPU is visible)")
    t.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes per rank for data sets that are not in-memory tensors (default 0)")
    t.add_argument("--auto-resume", action="store_true", help="continue from the newest checkpoint in --run-dir if there is one, else start fresh (for requeued jobs)")
    t.add_argument("--save-on-signal", default="", metavar="SIGNALS", help="on one of these signals (e.g. USR1,TERM) save a checkpoint at the next step boundary and stop")
    t.add_argument("--requeue", action="store_true", help="under SLURM: after a --save-on-signal stop, requeue the job (it resumes with --auto-resume)")
    t.add_argument("--on-nan", choices=("stop", "skip"), default="stop", help="a NaN/inf loss stops the run before the weights are touched (default), or skips that step on every rank")
    t.add_argument("--quiet", action="store_true", help="no per-epoch progress or summary; only errors (the run directory still gets everything)")
    t.add_argument("--progress", choices=("auto", "bar", "lines"), default="auto",
                   help="rank 0's progress: a tqdm bar, or plain lines for log files (default auto: bar on a terminal)")
    t.add_argument("--csv", action="store_true", help="also write RUN_DIR/metrics.csv (metrics.jsonl is always written)")
    t.add_argument("--tensorboard", action="store_true", help="also write TensorBoard event files to RUN_DIR/tensorboard")
    _add_strategy_flags(t, "ddp")
    _add_perf_flags(t)

    pl = sub.add_parser("plan", help="memory per rank under DDP and FSDP, and which one fits", description=PLAN_HELP)
    pl.add_argument("task", nargs="?", default="wine", help="wine (default), digits, MODULE:FUNCTION or FILE.py:FUNCTION")
    pl.add_argument("--nproc", "--nproc-per-node", dest="nproc", type=_nproc, default=None, metavar="N|auto",
                    help="processes (ranks) to plan for (default auto: one per GPU; 2 without GPUs)")
    _add_strategy_flags(pl, "auto")

    la = sub.add_parser("launch", help="run any script on N local workers (like torchrun)", description=LAUNCH_HELP)
    _add_process_flags(la)
    la.add_argument("-m", dest="module", action="store_true", help="run SCRIPT as a module (python -m SCRIPT)")
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
    s.add_argument("--signal", default="USR1@90", help="warning signal before the time limit: save, requeue, resume (default USR1@90; '' = none)")
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
    ev.add_argument("--nproc", type=_nproc, default=None, metavar="N|auto", help="the --nproc you plan to train with (default auto)")
    ev.add_argument("--json", action="store_true", help="print the report as JSON")

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
    b.add_argument("--batch-size", type=int, default=32, help="per process (default 32)")
    b.add_argument("--threads", type=int, default=None, help="CPU threads per process (default: cores / processes)")
    b.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    b.add_argument("--grad-sync", choices=GRAD_SYNC_MODES, default="auto",
                   help="gradient all-reduce of the step measurement, as for `ddpkit train` (default auto)")
    b.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    b.add_argument("--timeout", type=float, default=300.0)
    b.add_argument("--json", default=None, metavar="PATH", help="also write the measurements as JSON")
    return parser


SLURM_HELP = """Write an sbatch script that runs `ddpkit train` on every node of a SLURM allocation:
one srun task per GPU (per worker on CPU nodes), each task one ddpkit worker that reads its
rank from SLURM, started through `srun --kill-on-bad-exit=1`. The job asks for a warning
signal before its time limit; ddpkit then checkpoints at the next step, requeues the job,
and the requeued job resumes. Example:

  ddpkit slurm --nodes 2 --gpus-per-node 8 --time 04:00:00 --submit -- wine --epochs 100
"""


def train_config(ns: argparse.Namespace) -> Any:
    from .config import RunConfig

    return RunConfig(
        task=ns.task, epochs=ns.epochs, batch_size=ns.batch_size, lr=ns.lr, seed=ns.seed,
        shuffle=ns.shuffle, save_every=ns.save_every, eval_every=ns.eval_every, run_dir=ns.run_dir,
        resume=ns.resume, auto_resume=ns.auto_resume, save_on_signal=ns.save_on_signal, requeue=ns.requeue, on_nan=ns.on_nan,
        backend=ns.backend, device=ns.device, num_workers=ns.num_workers, quiet=ns.quiet, progress=ns.progress,
        csv=ns.csv, tensorboard=ns.tensorboard, **_process_config(ns), **_strategy_config(ns), **_perf_config(ns),
    )


def _strategy_config(ns: argparse.Namespace) -> dict[str, Any]:
    from .config import parse_memory

    return {"strategy": ns.strategy, "precision": ns.precision, "device_memory": parse_memory(ns.device_memory)}


def cmd_train(ns: argparse.Namespace) -> int:
    from .api import train

    train(train_config(ns), dry_run=ns.dry_run, _clean_parent=True)
    return 0


def cmd_launch(ns: argparse.Namespace) -> int:
    from .api import launch
    from .config import RunConfig

    argv = (["-m", ns.script] if ns.module else [ns.script]) + list(ns.args)
    return launch(argv, RunConfig(**_process_config(ns)), dry_run=ns.dry_run)


def cmd_slurm(ns: argparse.Namespace) -> int:
    import shlex
    from pathlib import Path

    from .launch import slurm

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
            raise DdpkitError(f"{flag} does not belong after --: SLURM starts the workers (use --nodes / --gpus-per-node / --ntasks-per-node of `ddpkit slurm`)")
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

    from .doctor import collect, format_report

    report = collect(nproc=ns.nproc)
    print(json.dumps(report, indent=2) if ns.json else format_report(report))
    return 0


def cmd_plot(ns: argparse.Namespace) -> int:
    from .plot import plot_runs

    print(f"wrote {plot_runs(ns.run_dirs, ns.out, ns.label, ns.title)}")
    return 0

def cmd_plan(ns: argparse.Namespace) -> int:
    from .api import memory_plan

    print(memory_plan(ns.task, nproc=ns.nproc, **_strategy_config(ns)).format(ns.task, ns.strategy), flush=True)
    return 0


def cmd_bench(ns: argparse.Namespace) -> int:
    from .bench import main_bench

    return main_bench(ns)


COMMANDS = {"train": cmd_train, "launch": cmd_launch, "slurm": cmd_slurm, "plan": cmd_plan, "env": cmd_env,
            "plot": cmd_plot, "bench": cmd_bench}


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
    if argv is None and ns.command in ("train", "bench") and not os.environ.get("DDPKIT_SLOW_EXIT"):
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
