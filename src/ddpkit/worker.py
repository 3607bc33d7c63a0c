"""What runs in every worker process of `ddpkit train`, whoever started it."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .checkpoint import hf_config
from .checkpoint.export import export_run
from .checkpoint.file import remove_stale_temporaries
from .checkpoint.world_mark import WorldMark
from .config import RunConfig
from .environments import DistEnv
from .envvars import (
    BENCH_RESULT_VAR,
    ERROR_DIR_VAR,
    LAUNCH_TIME_VAR,
    REQUEUE_FILE_VAR,
    error_file,
    max_restarts,
    restart_count,
)
from .errors import DdpkitError, RunDirTaken
from .reporting.rank_output import rank_stdout
from .reporting.run_state import record_failure
from .reporting.summary import format_summary
from .runtime import Runtime
from .runtime.watchdog import HangWatchdog, fresh_hang_dir, is_timeout
from .task import Task, as_task, build_task
from .textfile import write_text_atomic
from .training.loop import fit
from .training.signals import ENDING_SIGNALS, StopRequest
from .training.trace import DROPOUT_FILE, TRACE_DIR, dropout_off, to_float64


def _is_peer_loss(e: BaseException) -> bool:
    text = str(e)
    return any(s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"))


def another_rank_failed(e: BaseException) -> str | None:
    """Whether `e` is what another rank's failure does to this one: "stopped" when torch's agent
    is stopping this worker (its SIGTERM, raised as SignalException, often while this rank was
    handling the error of a collective), "peer" when a collective lost its peer; None for this
    rank's own failure. The rank that failed first is the one to name, with its traceback."""
    seen: BaseException | None = e
    chain = []
    while seen is not None and len(chain) < 10:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    if any(type(x).__name__ == "SignalException" for x in chain):
        return "stopped"
    return "peer" if any(_is_peer_loss(x) for x in chain) else None


def exception_line(e: BaseException) -> str:
    """`Type: the first line of its message`, short enough for one line of an error."""
    first = (str(e).strip().splitlines() or [""])[0]
    first = first if len(first) <= 300 else first[:300] + "..."
    return f"{type(e).__name__}: {first}".rstrip(": ")


def _dropout_off(model: torch.nn.Module, is_main: bool, run_dir: Path) -> None:
    """`ddpkit verify`'s runs: no dropout mask drawn per rank; the report names what was turned off."""
    turned_off = dropout_off(model)
    if is_main:
        (run_dir / TRACE_DIR).mkdir(parents=True, exist_ok=True)
        write_text_atomic(run_dir / TRACE_DIR / DROPOUT_FILE, json.dumps(turned_off) + "\n")


def _say_rejoining(e: RunDirTaken, env: DistEnv) -> None:
    """The agent restarts this node's workers to rejoin the job, and the launcher reports nothing:
    each node says why, at once (the agent stops this process as soon as another rank has left)."""
    if os.environ.get(ERROR_DIR_VAR) and _restarts_left() and env.local_rank == 0:
        print(f"ddpkit: warning: {e}; restarting this node's workers", file=sys.stderr, flush=True)


def _restarts_left() -> bool:
    """Will torch's agent restart this node's workers after a failure (--max-restarts not used up)?"""
    return max_restarts() > restart_count()


def die_with_parent() -> None:
    """A worker of ddpkit's own launcher must not outlive it (a SIGKILLed launcher cannot
    stop its workers): ask Linux to kill this process when its parent dies."""
    if sys.platform != "linux":
        return
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() == 1:  # the parent died before we asked
        os._exit(1)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train_worker(config: dict[str, Any], task: Task | None = None) -> dict[str, Any]:
    """Entry point of one worker. Returns the run summary. A DdpkitError is also written
    where the launcher looks for it, so the user sees one clear line, not N tracebacks.
    `task`: a Task object every worker already holds (forked from a notebook) instead of
    the one config.task names."""
    cfg = RunConfig.from_dict(config)
    env = DistEnv.detect()
    error_dir = os.environ.get(ERROR_DIR_VAR)
    if error_dir:
        die_with_parent()
    try:
        # rank 0 prints; --verbose: whole lines from all. `held`: the signal handlers, kept to the end
        with rank_stdout(env.rank, env.world_size, cfg.verbose), contextlib.ExitStack() as held:
            summary = _train(cfg, env, held, task)
        if error_dir and summary.get("stopped_early") and summary.get("stop_signal") in ENDING_SIGNALS:
            # Ctrl-C or a TERM reached ddpkit's launcher too: its agent is shutting the group down and
            # will not read a return value, so a worker that waited to hand one over would sit there
            # until the agent's 30 s kill. The checkpoint is written: leave now.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        return summary
    except DdpkitError as e:
        if not error_dir:  # started by torchrun/srun/in-process: the caller reports it
            raise
        if isinstance(e, RunDirTaken) and _restarts_left():
            sys.exit(2)  # said already (_say_rejoining); no error file that a later failure would show
        error_file(error_dir, f"rank-{env.rank}.txt").write_text(str(e))
        sys.exit(2)
    except Exception as e:
        if not error_dir:
            raise
        if type(e).__name__ == "SignalException":  # the agent is stopping us: another rank failed
            os._exit(1)
        if _is_peer_loss(e):  # a consequence of another rank's failure: one line, not a traceback
            line = f"rank {env.rank} lost contact with another rank ({str(e).splitlines()[0][:200]})"
            error_file(error_dir, f"peer-{env.rank}.txt").write_text(line)
            print(f"[rank {env.rank}] {line}", file=sys.stderr, flush=True)
            os._exit(1)
        # One traceback, from the rank that failed; the launcher adds one line naming it, the
        # exception and its message (read from this rank's file)
        record_failure(cfg.run_dir or "runs/latest", e, env.rank)
        print(f"[rank {env.rank}] " + traceback.format_exc(), file=sys.stderr, flush=True)
        error_file(error_dir, f"raised-{env.rank}.txt").write_text(exception_line(e))
        sys.exit(1)


def _train(cfg: RunConfig, env: DistEnv, held: contextlib.ExitStack, given: Task | None = None) -> dict[str, Any]:
    run_dir = Path(cfg.run_dir or "runs/latest")
    # torch's flight recorder keeps the process group's last collectives (op, sizes, sequence
    # number) for a hang report, on gloo and NCCL (no cost measurable next to gloo's latency)
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    with Runtime(env, cfg.device, cfg.backend, cfg.timeout, cfg.threads) as rt:
        watchdog = None
        if rt.distributed:  # every rank reports where it is when the job hangs (runtime/watchdog.py)
            hang = cfg.hang_seconds
            if rt.backend == "nccl" and cfg.hang_timeout is None:
                hang = 0.9 * cfg.timeout  # torch aborts a process whose NCCL collective passes --timeout: report first
            watchdog = HangWatchdog(
                run_dir / "hang",
                env.rank,
                env.world_size,
                hang,
                os.environ.get(ERROR_DIR_VAR),
                launcher_prints=bool(os.environ.get(ERROR_DIR_VAR)),
                record=rt.record,
            )
            watchdog.start()
        seed_everything(cfg.seed)  # the same model on every rank, whatever the world size
        task = build_task(cfg.task, cfg) if given is None else as_task(given, "notebook")
        if cfg.export == "hf":
            hf_config.check_hf(task.model)  # on every rank, before any training
        if cfg.float64:
            task.model = to_float64(task.model)
        if cfg.dropout_off:
            _dropout_off(task.model, rt.is_main, run_dir)
        if watchdog is not None:
            watchdog.watch_model(task.model)  # a forward pass is progress
        draws = cfg.seed if cfg.draws_seed is None else cfg.draws_seed  # verify's probe: other draws, same model
        seed_everything(draws + 1 + env.rank)  # then per-rank streams (dropout, augmentation)
        mark = WorldMark(run_dir, rt.is_main, env.world_size, env.nnodes)  # the folder is this world's once it starts
        # the Hugging Face config of the model as built (before a strategy shards it), kept aside until the start
        hf, not_kept = hf_config.prepare(task.model, required=cfg.export == "hf") if rt.is_main else (None, None)
        if hf is not None:
            held.callback(shutil.rmtree, hf, ignore_errors=True)  # once moved into the run, nothing is left there
        if restart_count() > 0:
            cfg = cfg.replace(auto_resume=True)  # restarted after a failure: continue, don't redo
        # Its handlers stay until the summary is written and the requeue asked for (they leave with
        # `held`): a second signal during the save or after it must not kill this process.
        stop = held.enter_context(StopRequest(cfg.save_on_signal.split(","))) if cfg.save_on_signal else None
        if not_kept:
            print(f"ddpkit: warning: {not_kept}; `ddpkit export --format hf` will refuse this run", flush=True)
        fit_start = time.time()
        try:
            stats = fit(cfg, task, rt, run_dir, stop, mark, begin=lambda: _begin(cfg, rt.is_main, run_dir, mark, hf))
        except Exception as e:
            if isinstance(e, RunDirTaken):
                _say_rejoining(e, env)
            if watchdog is not None and is_timeout(e):
                watchdog.on_error(e)  # every rank's stacks and collectives, before the job is torn down
            raise
        finally:
            if watchdog is not None:
                watchdog.stop()
        fit_end = time.time()
        del task  # holds the model; drop it before the process group goes
        if stats["stopped_early"] and cfg.requeue and env.is_main and stop is not None:
            request_requeue(stop)
        batches = cfg.batch_plan(env.world_size)
        summary = {
            "world_size": env.world_size,
            "nnodes": env.nnodes,
            "backend": rt.backend if env.distributed else "none",
            "device": str(rt.device),
            "batch_size": cfg.batch_size,
            "global_batch": batches.global_batch,
            "global_batch_fixed": batches.fixed,
            "accumulate": batches.accumulate,
            "epochs": cfg.epochs,
            "max_steps": cfg.max_steps,
            "eval_every_steps": cfg.eval_every_steps,
            "save_every_steps": cfg.save_every_steps,
            **stats,
            "run_dir": str(run_dir),
        }
    if mark.lost():  # rank 0, after the last collective: the other world's export and summary stay
        taken = mark.error("the end of the run, before summary.json")
        _say_rejoining(taken, env)
        raise taken
    if cfg.export and env.is_main and not stats["stopped_early"]:  # the process group is down: rank 0 alone
        export_run(run_dir, cfg.export, run_dir / "export", replace=True, say=print if not cfg.quiet else _silent)
    launched = float(os.environ.get(LAUNCH_TIME_VAR, "0") or 0)
    if launched:
        summary["wall_s"] = time.time() - launched
        # phases, seconds since the command started: startup (imports, workers, process
        # group, task) ends when fit() starts; fit_end_s is when training, evaluation and
        # checkpoints are done (teardown = exit time - fit_end_s, measured from outside)
        summary["startup_s"] = fit_start - launched
        summary["fit_s"] = fit_end - fit_start
        summary["fit_end_s"] = fit_end - launched
    if env.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if not cfg.quiet or os.environ.get(BENCH_RESULT_VAR):
            print(format_summary(summary), flush=True)
        if os.environ.get(BENCH_RESULT_VAR):
            print("RESULT " + json.dumps(summary), flush=True)
    return summary


def _silent(line: str) -> None:
    pass


def _begin(cfg: RunConfig, is_main: bool, run_dir: Path, mark: WorldMark, hf: Path | None) -> None:
    """Rank 0, once nothing refused the run (the task, --init-from, the resume): the folder is
    this world's from now on. Everything the start writes is written here, so a refusal before
    it leaves the run directory as it was (a finished run stays finished). A full disk is one line.
    `hf`: the model's Hugging Face config, prepared aside (hf_config.prepare)."""
    if not is_main:
        return
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(run_dir)  # what a killed save left: it may be what filled the disk
        mark.claim()  # before this world writes there: a world still training there stops at its next step
        fresh_hang_dir(run_dir / "hang")
        (run_dir / "config.json").write_text(json.dumps(cfg.as_dict(), indent=2) + "\n")
        if hf is not None:
            hf_config.put(hf, run_dir)  # for export --format hf
    except OSError as e:
        raise DdpkitError(
            f"cannot write to the run directory {run_dir}: {e.strerror or e} ({e.filename or run_dir}); "
            "free space (or fix the folder) and start again (with --resume to continue)"
        ) from None


def request_requeue(stop: StopRequest) -> None:
    """Put this SLURM job back in the queue after the checkpoint of a warning signal; it resumes
    from it (--auto-resume). A job that SIGTERM/SIGINT stopped is being ended (scancel) or requeued
    (preemption) by SLURM itself: asking again would bring back a cancelled job.
    The batch script `ddpkit slurm` writes names a file in REQUEUE_FILE_VAR: rank 0 writes it and
    the script requeues the job from the batch host once srun is done, so `scontrol` need not exist
    where the workers run (a container). Without it, rank 0 runs `scontrol requeue` itself."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        print("ddpkit: --requeue: not inside a SLURM job; stopping after the checkpoint instead", flush=True)
        return
    if not stop.wants_requeue:
        print(f"ddpkit: checkpoint saved; stopped by {stop.received}: SLURM ends or requeues the job", flush=True)
        return
    request = os.environ.get(REQUEUE_FILE_VAR)
    if request:
        write_text_atomic(request, f"{job}\n")  # the batch script sees the whole request or none
        print(f"ddpkit: checkpoint saved; the batch script requeues SLURM job {job}", flush=True)
        return
    requeue_slurm_job(job)


def requeue_slurm_job(job: str) -> None:
    """SLURM kills this job's processes as soon as the requeue is accepted: say it first. An
    array element is named by array id and index: `scontrol requeue` takes one element's JobId,
    which is also the array's id, for the whole array."""
    print(f"ddpkit: checkpoint saved; requeueing SLURM job {job}", flush=True)
    array, index = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    target = f"{array}_{index}" if array and index else job
    try:
        done = subprocess.run(["scontrol", "requeue", target], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        print(
            f"ddpkit: scontrol is not available here (a container?): SLURM job {job} was not requeued; resubmit it, "
            "or run the script `ddpkit slurm` writes, which requeues from the batch host",
            file=sys.stderr,
            flush=True,
        )
        return
    if done.returncode != 0:
        print(
            f"ddpkit: scontrol requeue {job} failed: {done.stderr.strip()}; resubmit the job to continue",
            file=sys.stderr,
            flush=True,
        )
