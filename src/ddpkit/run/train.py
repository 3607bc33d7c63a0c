"""The Python API: `train()` for a whole run, `init()` for users who keep their own loop."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

from ..checkpoint.run_dir import refuse_linked_files
from ..checkpoint.world_mark import started_by_this_launch
from ..config import RunConfig
from ..environments import DistEnv
from ..errors import DdpkitError, Interrupted
from ..launchers.elastic import run_elastic
from ..launchers.plan import describe, make_launch_plan, resolve_nproc
from ..launchers.report import RESUME_TRAIN
from ..parallel.spec import check
from ..reporting.run_state import end_killed_run, record_failure, stopped_by
from ..reporting.sinks import end_abandoned_trackers
from ..reporting.sinks.base import FAILED, STOPPED
from ..runtime import default_threads, resolve_device_type
from ..runtime.devices import workers_backend
from ..storage.location import is_url
from ..training.signals import ENDING_SIGNALS
from ..util.envvars import LAUNCH_ID_VAR, LAUNCH_TIME_VAR
from .staging import init_from_fetched, staged

_LAUNCH_TIMES_SET: set[str] = set()  # the launch times this process's own train() calls set


def _mark_launch_time() -> None:
    """The run's clock (the summary's wall time and time ledger) starts now, unless a launcher or
    the command line started it earlier for this run; a time an earlier train() call of this
    process set (a notebook's second run) is that run's, not this one's."""
    current = os.environ.get(LAUNCH_TIME_VAR)
    if current is None or current in _LAUNCH_TIMES_SET:
        now = repr(time.time())
        os.environ[LAUNCH_TIME_VAR] = now
        _LAUNCH_TIMES_SET.add(now)


def train(
    config: RunConfig | None = None, *, dry_run: bool = False, _clean_parent: bool = False, **overrides: Any
) -> dict[str, Any]:
    """Train a task with the given settings and return rank 0's summary.

    Inside a launcher (torchrun, `ddpkit launch`, an srun task) this process is one worker;
    otherwise ddpkit starts this node's workers itself. With dry_run, print the launch plan
    and start nothing. (`_clean_parent`: the caller, the CLI, guarantees this process has run
    no torch op, so workers may be forked from it.)

    A run that Ctrl-C or a TERM named in `save_on_signal` stopped raises `ddpkit.errors.Interrupted`
    once the stop's checkpoint is written (its `saved_step`), at any nproc, one process included,
    as a scheduler expects of a run that did not finish; another signal of `save_on_signal` (a
    requeue's USR1) returns the summary, whose `stopped_early` is true.
    """
    cfg = (config or RunConfig()).replace(**overrides) if overrides else (config or RunConfig())
    os.environ[LAUNCH_ID_VAR] = uuid.uuid4().hex  # the run directory's mark names this launch once it starts
    from .worker import train_worker

    env = DistEnv.detect()
    if env.outside_launcher:
        os.environ.setdefault(LAUNCH_TIME_VAR, repr(time.time()))  # the launcher's clock where it set one
        return _train_as_worker(cfg, env, dry_run)
    _mark_launch_time()
    device_type = resolve_device_type(cfg.device)
    nproc = resolve_nproc(cfg.nproc, device_type)
    backend = workers_backend(cfg.backend, device_type, nproc)  # refuse nccl without GPU before starting anything
    plan = make_launch_plan(cfg, nproc, device_type, _clean_parent, cfg.threads or default_threads(nproc))
    if dry_run:
        _print_dry_run(cfg, plan, backend, nproc, device_type)
        return {"plan": plan}
    _check_strategy(cfg, device_type, nproc * plan.max_nodes, nproc)
    _check_task_exists(cfg)  # before the run directory is made: a task that cannot load leaves none
    _check_split(cfg, plan.start_method)
    cfg = cfg if cfg.run_dir else cfg.replace(run_dir=str(default_run_dir(cfg)))
    with staged(cfg) as cfg, init_from_fetched(cfg) as cfg:  # a bucket: checked now, before any worker starts
        new = _missing_folders(cfg.run_dir)
        cfg = prepare_local_run(cfg)
        _end_killed_attempt(cfg)
        in_process = nproc == 1 and not cfg.multi_node and not cfg.rdzv_endpoint and cfg.max_restarts == 0
        with failure_recorded(cfg.run_dir, made=new):
            if in_process:
                return _ended_by_signal(cfg, train_worker(cfg.as_dict()), 1)
            hang_dir = Path(cfg.run_dir) / "hang"
            try:
                results = run_elastic(
                    plan, train_worker, [cfg.as_dict()], verbose=cfg.verbose, hang_dir=hang_dir, restarted=RESUME_TRAIN
                )
            except Interrupted as e:
                raise Interrupted(e.signum, f"{e}{_after_signal(cfg, e.signum, e.saved_step)}", e.saved_step) from None
    return results.get(0, {}) if isinstance(results, dict) else results[0]


def _train_as_worker(cfg: RunConfig, env: DistEnv, dry_run: bool) -> dict[str, Any]:
    """train() in a process an outside launcher started (torchrun, srun, mpirun): this process is
    one worker; a scheduler's job id names the default run directory (a requeued job continues there)."""
    from .worker import train_worker

    check_request_matches_launcher(cfg, env)
    if is_url(cfg.run_dir):
        raise DdpkitError(
            f"--run-dir {cfg.run_dir}: a run stored in a bucket is started by `ddpkit train` itself (it checks "
            f"the bucket, stages the run and commits each checkpoint); under {env.environment.starter} give a "
            "local or shared folder"
        )
    if dry_run:
        print(describe_worker(env, cfg))
        return {"plan": env.as_dict()}
    job = env.environment.job_id(os.environ)
    if job and not cfg.run_dir:
        cfg = cfg.replace(run_dir=f"runs/{_task_slug(cfg.task)}-job{job}")
    with failure_recorded(cfg.run_dir if env.is_main else None):
        summary = train_worker(cfg.as_dict())
    return _ended_by_signal(cfg, summary, env.world_size)


def _ended_by_signal(cfg: RunConfig, summary: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The summary of a run of one worker, in this process; an Interrupted (exit 128 + N, as a
    launch of several workers ends) when a TERM or Ctrl-C stopped it: a scheduler or Kubernetes
    must not record a success for a run that did not finish (a one-worker PyTorchJob's pod, evicted,
    would count as done and never start again). With several workers under an outside launcher
    (srun, torchrun, a PyTorchJob's pods) each returns as before: its launcher decides the job's
    status, and a task that left first would get the others killed before rank 0's summary."""
    name = summary.get("stop_signal") if isinstance(summary, dict) and summary.get("stopped_early") else None
    if world_size != 1 or name not in ENDING_SIGNALS:
        return summary
    signum = signal.Signals[name]
    saved = summary.get("checkpoint_step")
    if isinstance(saved, int) and saved == summary.get("steps_done"):  # the stop's own checkpoint was written
        raise Interrupted(signum, f"stopped by {name}{_after_signal(cfg, signum, saved)}", saved)
    raise Interrupted(signum, f"stopped by {name}{_nothing_saved(cfg, signum)}")


def _end_killed_attempt(cfg: RunConfig) -> None:
    """A resume of a run killed without a word: the tracker runs it left running are marked KILLED
    first (with one line), as `ddpkit runs` does; the resume then continues them."""
    if cfg.resume or cfg.auto_resume:
        said = end_killed_run(cfg.run_dir)
        if said:
            print(f"ddpkit: {said}; this resume continues it", file=sys.stderr, flush=True)


def _print_dry_run(cfg: RunConfig, plan: Any, backend: str, nproc: int, device_type: str) -> None:
    """--dry-run: the launch plan and, unless --strategy ddp, what fsdp / auto would hold per rank
    (builds the task, trains nothing)."""
    print(describe(plan, backend if nproc * plan.max_nodes > 1 else "none (one process)", device_type))
    if cfg.strategy != "ddp":
        from ..run.plan import run_memory_plan

        print(
            run_memory_plan(cfg, nproc * plan.max_nodes, plan.max_nodes, nproc, plan.start_method).format(
                cfg.task, cfg.strategy
            )
        )


def _after_signal(cfg: RunConfig, signum: int, saved_step: int | None = None) -> str:
    """What a run stopped by a signal left to continue from, and how (the launcher's line goes on).
    `saved_step`: this node's workers said they saved at that step (rank 0's summary.json, on
    another node, may not be written yet)."""
    from ..reporting.run_state import run_state

    run_dir = Path(cfg.run_dir or ".")
    state = run_state(run_dir) if saved_step is None else {"state": "stopped", "summary": {"steps_done": saved_step}}
    if state["state"] == "stopped":
        steps = (state.get("summary") or {}).get("steps_done")
        at = f" at step {steps}" if steps is not None else ""
        return f" after saving a checkpoint{at}: continue with --resume --run-dir {run_dir}"
    return _nothing_saved(cfg, signum)


def _nothing_saved(cfg: RunConfig, signum: int) -> str:
    """What a run stopped by a signal before its stop's checkpoint was written can continue from."""
    run_dir = Path(cfg.run_dir or ".")
    checkpoints = run_dir / "checkpoints"
    name = signal.Signals(signum).name.removeprefix("SIG")
    covered = name in {n.strip().upper().removeprefix("SIG") for n in cfg.save_on_signal.split(",")}
    hint = "" if covered else f" (--save-on-signal {name} saves one first)"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        return f"; nothing newer was saved{hint}: --resume continues from the newest checkpoint in {checkpoints}"
    return f" before a checkpoint was written{hint}"


@contextlib.contextmanager
def failure_recorded(run_dir: str | None, made: list[Path] | None = None) -> Iterator[None]:
    """A run that fails after it started says so in its folder (failed.json, for `ddpkit runs`),
    and in the tracker runs its rank 0 left running (killed before it could end them); one
    refused or stopped by a signal before its start leaves the folder as it was: the folders
    this launch `made` for it are removed again (when nothing else was put there)."""
    try:
        yield
    except BaseException as e:
        if run_dir:
            record_failure(run_dir, e)
            end_abandoned_trackers(run_dir, STOPPED if stopped_by(e) else FAILED)
            if made and not started_by_this_launch(run_dir):
                for folder in made:  # the deepest first
                    with contextlib.suppress(OSError):
                        folder.rmdir()  # only if empty
        raise


def _missing_folders(run_dir: str) -> list[Path]:
    """The run directory and its parents that do not exist yet, deepest first."""
    missing = []
    for folder in [Path(run_dir), *Path(run_dir).parents]:
        if folder.exists() or str(folder) in ("", "."):
            break
        missing.append(folder)
    return missing


def check_request_matches_launcher(cfg: RunConfig, env: DistEnv) -> None:
    """Inside torchrun or srun the processes already exist: asking ddpkit to start more
    would multiply them (the guide's GPUs-squared bug). Refuse requests that disagree."""
    who = env.environment.starter
    if cfg.nproc is not None and cfg.nproc != env.local_world_size:
        raise DdpkitError(
            f"{who} already started {env.local_world_size} process(es) on this node, each one ddpkit worker; "
            f"--nproc {cfg.nproc} would start more inside each: drop --nproc, or {env.environment.nproc_fix}"
        )
    if cfg.nnodes != "1" and cfg.node_range[1] != env.nnodes:
        raise DdpkitError(
            f"--nnodes {cfg.nnodes} but {who} started this job on {env.nnodes} node(s): drop --nnodes, "
            "or ask the scheduler for that many nodes (sbatch --nodes)"
        )
    env.environment.check_devices(env.local_world_size, resolve_device_type(cfg.device))


def describe_worker(env: DistEnv, cfg: RunConfig) -> str:
    return "\n".join(
        [
            f"ddpkit: started by {env.launcher} (dry run: nothing trained)",
            f"  rank {env.rank} of world size {env.world_size}; local rank {env.local_rank} of {env.local_world_size}; "
            f"node {env.node_rank} of {env.nnodes}",
            f"  master {env.master_addr}:{env.master_port}",
            f"  device {resolve_device_type(cfg.device)}, "
            f"backend {workers_backend(cfg.backend, resolve_device_type(cfg.device), env.local_world_size)}",
        ]
    )


def prepare_local_run(cfg: RunConfig) -> RunConfig:
    """Pick the run directory and make sure starting (or resuming) there loses nothing."""
    run_dir = Path(cfg.run_dir) if cfg.run_dir else default_run_dir(cfg)
    if cfg.auto_resume:
        pass  # continue whatever is there, or start fresh
    elif cfg.resume:
        if not (run_dir / "checkpoints").is_dir():
            raise DdpkitError(
                f"--resume: no checkpoint in {run_dir / 'checkpoints'}; run without --resume to start fresh"
            )
    elif (run_dir / "checkpoints").exists() or (run_dir / "model.pt").exists():
        raise DdpkitError(f"{run_dir} already holds a run: pass --resume to continue it, or choose another --run-dir")
    refuse_linked_files(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        # a probe of our own: every node of a multi-node job runs this on the same folder at once
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".ddpkit-write-test-"):
            pass
    except OSError as e:
        raise DdpkitError(f"cannot write to run directory {run_dir}: {e.strerror}; choose another --run-dir") from None
    return cfg.replace(run_dir=str(run_dir))


def default_run_dir(cfg: RunConfig) -> Path:
    """runs/TASK-DATE-TIME: where a run goes without --run-dir."""
    return Path("runs") / f"{_task_slug(cfg.task)}-{time.strftime('%Y%m%d-%H%M%S')}"


def _check_strategy(cfg: RunConfig, device_type: str, nproc: int, local: int | None = None) -> None:
    """Refuse before any worker starts what the workers would refuse (`nproc`: the largest world,
    `local`: one node's processes)."""
    check(cfg.strategy_config(), nproc, local_world_size=local)
    cfg.batch_plan(nproc)
    if device_type == "cpu":  # (asking a GPU here would initialise CUDA in the launcher)
        from ..strategies.precision import check_precision

        check_precision(cfg.precision, device_type)


def _task_slug(task: str) -> str:
    name = task.rpartition(":")[2] if ":" in task else task
    base = Path(task.rpartition(":")[0]).stem if ":" in task else ""
    return "-".join(p for p in (base, name) if p) or "task"


def _check_split(cfg: RunConfig, start_method: str) -> None:
    """--tp: the task built on the meta device, as the memory plan builds it, and its tensor-parallel
    plan checked against the model before any worker starts or a run directory is made (a fused
    q/k/v, a pattern that matches nothing, a dimension --tp does not divide: one line). In a fork of
    this process when the workers will be forked from it (it stays as clean as they need). A task
    that cannot be built so (it reads its weights' values) is left to its workers, which check again."""
    if cfg.tp <= 1:
        return
    if start_method == "fork":
        from .plan import _in_a_fork

        said = _in_a_fork(lambda: _split_refusal(cfg), timeout=120.0)()
    else:  # spawned workers: here, the caller's random states kept as they were
        import random

        import numpy as np
        import torch

        states = random.getstate(), np.random.get_state(), torch.get_rng_state()
        try:
            said = _split_refusal(cfg)
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.set_rng_state(states[2])
    if isinstance(said, str):
        raise DdpkitError(said)


def _split_refusal(cfg: RunConfig) -> str | None:
    """What the workers would refuse in one line when they split the model, or None."""
    from ..strategies.materialize import parameters_on_meta
    from ..strategies.tensor_parallel import checked_plan
    from ..task import build_task
    from .worker import seed_everything

    seed_everything(cfg.seed)
    try:
        with parameters_on_meta():
            task = build_task(cfg.task, cfg)
        checked_plan(task.model, task.tp_plan, cfg.tp)
    except DdpkitError as e:
        return str(e)
    except Exception:  # not buildable on the meta device: the workers check
        return None
    return None


def _check_task_exists(cfg: RunConfig) -> None:
    """Fail in the launcher, before any worker starts, when the task cannot be found or does
    not take the --task-arg names."""
    from ..task import check_task_call, load_task_function

    check_task_call(cfg.task, load_task_function(cfg.task), cfg.task_args)
