"""What runs in every worker process of `ddpkit train`, whoever started it."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Iterator, NoReturn

import numpy as np
import torch

from ..checkpoint import hf_config
from ..checkpoint.export import export_run
from ..checkpoint.run_dir import prepare_run_dir
from ..config import RunConfig
from ..environments import DistEnv
from ..environments.registry import request_requeue
from ..errors import DdpkitError, RunDirTaken
from ..parallel.spec import mesh_dims
from ..planning.process import load_what_every_worker_loads, measure_process, sharding_import_cost
from ..reporting.rank_output import rank_stdout
from ..reporting.run_state import record_failure
from ..reporting.summary import add_phases, add_time, run_summary, write_summary
from ..runtime import Runtime
from ..runtime.allocator import release_freed_memory, sized_to_memory
from ..runtime.determinism import deterministic
from ..runtime.devices import resolve_device_type
from ..runtime.watchdog import HangWatchdog, start_watchdog, watched
from ..task import Task, as_task, build_task
from ..training.auto import resolve_auto
from ..training.batch_auto import resolve_batch_auto
from ..training.ledger import Ledger
from ..training.loop import fit
from ..training.oom import OOM_FILE, OomAdvice, OutOfMemory, oom_error
from ..training.signals import ENDING_SIGNALS, StopRequest, hand_over
from ..training.trace import DROPOUT_FILE, TRACE_DIR, dropout_off, to_float64
from ..util.envvars import ERROR_DIR_VAR, error_file, max_restarts, restart_count
from ..util.textfile import write_text_atomic


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
    where the launcher looks for it, so the user sees one clear line, not N tracebacks; so is
    running out of memory, in the few lines of training/oom.py.
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
    except Exception as e:
        if isinstance(e, OutOfMemory) or (not isinstance(e, DdpkitError) and oom_error(e) is not None):
            _out_of_memory(e, cfg, env, error_dir)
        if isinstance(e, DdpkitError):
            _refused(e, env, error_dir)
        _failed(e, cfg, env, error_dir)


def _refused(e: DdpkitError, env: DistEnv, error_dir: str | None) -> NoReturn:
    """A refusal of the user's input: one line for the launcher (exit 2)."""
    if not error_dir:  # started by torchrun/srun/in-process: the caller reports it
        raise e
    if isinstance(e, RunDirTaken) and _restarts_left():
        sys.exit(2)  # said already (_say_rejoining); no error file that a later failure would show
    error_file(error_dir, f"rank-{env.rank}.txt").write_text(str(e))
    sys.exit(2)


def _out_of_memory(e: Exception, cfg: RunConfig, env: DistEnv, error_dir: str | None) -> NoReturn:
    """This rank ran out of memory: the few lines of training/oom.py (OutOfMemory, raised by fit;
    made here for an error before it, e.g. while the task was built), recorded in the run's folder
    and handed to the launcher as the job's error, without a traceback (exit 1)."""
    run_dir = Path(cfg.run_dir or "runs/latest")
    if not isinstance(e, OutOfMemory):
        device = "cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu"
        e = OomAdvice.of(cfg, env, run_dir, device).error(e)
    record_failure(run_dir, e)  # its message names the rank
    if not error_dir:  # torchrun, srun, in-process: the caller says it, without the traceback of the error
        raise e from None
    error_file(error_dir, OOM_FILE.format(rank=env.rank)).write_text(str(e))
    sys.exit(1)


def _failed(e: Exception, cfg: RunConfig, env: DistEnv, error_dir: str | None) -> NoReturn:
    """Any other failure: a lost peer in one line, this rank's own error with its traceback."""
    if not error_dir:
        raise e
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
    print(f"[rank {env.rank}] " + "".join(traceback.format_exception(e)), file=sys.stderr, flush=True)
    error_file(error_dir, f"raised-{env.rank}.txt").write_text(exception_line(e))
    sys.exit(1)


def _train(cfg: RunConfig, env: DistEnv, held: contextlib.ExitStack, given: Task | None = None) -> dict[str, Any]:
    """One run, stage by stage: the process group and the hang watchdog (runtime/), the task,
    the run directory's start prepared (checkpoint/run_dir.py), the batches planned once for this
    world (the loop trains with this plan), training (training/loop.py), the requeue a signal asked
    for (environments/), the summary (reporting/summary.py). `held`: the signal handlers, kept
    until the summary is written and the requeue asked for."""
    run_dir = Path(cfg.run_dir or "runs/latest")
    ledger = Ledger()  # where the wall time goes, from the launch (training/ledger.py)
    # torch's flight recorder keeps the process group's last collectives (op, sizes, sequence
    # number) for a hang report, on gloo and NCCL (no cost measurable next to gloo's latency)
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    # on a CPU, freed blocks go back to the system: the peak is what the memory plan counts
    sized = sized_to_memory(cfg.strategy, cfg.device_memory)
    release = release_freed_memory(cfg.cpu_allocator, sized) if resolve_device_type(cfg.device) == "cpu" else True
    # --deterministic: before CUDA starts (cuBLAS reads its workspace setting then) and the model is built
    with deterministic(cfg.deterministic), Runtime(env, cfg.device, cfg.backend, cfg.timeout, cfg.threads) as rt:
        ledger.mark("process_group")
        watchdog = start_watchdog(cfg, rt, run_dir / "hang")  # every rank reports where it is when the job hangs
        task = _build_task(cfg, rt, run_dir, given, watchdog)
        load_what_every_worker_loads()  # by its first step anyway: counted in its fixed cost
        sharded = sharding_import_cost() if cfg.strategy == "auto" else 0  # auto weighs FSDP's modules too
        process = measure_process(task.model, rt.device.type, release, sharded)
        cfg, chosen = _resolved(cfg, rt, task, process, run_dir)  # --strategy auto, --batch-size auto
        # the job's mesh, which every part asks (the sampler, the loss, the strategy): parallel/dims.py
        rt.dims = mesh_dims(cfg.strategy_config(), env.world_size, env.nnodes, env.local_world_size, env.rank)
        ledger.mark("task")
        if restart_count() > 0:
            cfg = cfg.replace(auto_resume=True)  # restarted after a failure: continue, don't redo
        start = prepare_run_dir(cfg, run_dir, rt.is_main, env.world_size, env.nnodes, task.model, held)
        # Its handlers stay until the summary is written and the requeue asked for (they leave with
        # `held`): a second signal during the save or after it must not kill this process.
        stop = held.enter_context(StopRequest(cfg.save_on_signal.split(","))) if cfg.save_on_signal else None
        if start.not_kept:
            print(f"ddpkit: warning: {start.not_kept}; `ddpkit export --format hf` will refuse this run", flush=True)
        batches = cfg.batch_plan(env.world_size)  # planned once: the loop trains with it, the summary shows it
        fit_start = time.time()
        # what a rank that runs out of memory says (note_plan: a line of the memory plan with it)
        oom = OomAdvice.of(cfg, env, run_dir, rt.device.type)
        if chosen:
            oom.note_plan(chosen)
        with watched(watchdog), _rejoining(env):
            stats = fit(cfg, task, rt, run_dir, batches, stop, start.mark, start.begin, process.fixed, oom, ledger)
        fit_end = time.time()
        del task  # holds the model; drop it before the process group goes
        if stats["stopped_early"] and cfg.requeue and env.is_main and stop is not None:
            request_requeue(stop)
        summary = run_summary(cfg, env, rt, batches, stats, run_dir)
    if start.mark.lost():  # rank 0, after the last collective: the other world's export and summary stay
        taken = start.mark.error("the end of the run, before summary.json")
        _say_rejoining(taken, env)
        raise taken
    if cfg.export and env.is_main and not stats["stopped_early"]:  # the process group is down: rank 0 alone
        export_run(run_dir, cfg.export, run_dir / "export", replace=True, say=print if not cfg.quiet else _silent)
    add_phases(summary, fit_start, fit_end)
    add_time(summary)
    if env.is_main:
        write_summary(summary, run_dir, cfg.quiet)
    if stats["stopped_early"]:  # all written: the launcher may stop this node's workers now
        hand_over(stop, summary, env.local_rank)
    return summary


def _resolved(cfg: RunConfig, rt: Runtime, task: Task, process: Any, run_dir: Path) -> tuple[RunConfig, str | None]:
    """What auto decides once, the same on every rank, before the batches are planned and the
    data loader built: --strategy auto's strategy, checkpointing and micro-batch, or the
    micro-batch --batch-size auto fits to the run's strategy; and the line that says it."""
    cfg, chosen = resolve_auto(cfg, rt, task, process)
    cfg, sized = resolve_batch_auto(cfg, rt, task, process, run_dir)
    return cfg, chosen or sized


def _build_task(cfg: RunConfig, rt: Runtime, run_dir: Path, given: Task | None, watchdog: HangWatchdog | None) -> Task:
    """The task, the same model on every rank whatever the world size (`given`: a notebook's own
    Task), made as the run asks (--export hf checked, --float64, --dropout-off), watched by the
    watchdog; then per-rank random streams (dropout, augmentation)."""
    seed_everything(cfg.seed)
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
    seed_everything(draws + 1 + rt.env.rank)
    return task


@contextlib.contextmanager
def _rejoining(env: DistEnv) -> Iterator[None]:
    """Training, where another world taking the run directory over (RunDirTaken) is said at once."""
    try:
        yield
    except RunDirTaken as e:
        _say_rejoining(e, env)
        raise


def _silent(line: str) -> None:
    pass
