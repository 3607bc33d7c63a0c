"""The Python API: `train()` for a whole run, `init()` for users who keep their own loop."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from .config import RunConfig
from .env import DistEnv
from .errors import DdpkitError
from .launch.local import LaunchPlan, run_elastic, start_method_for
from .runtime import Runtime, cuda_device_count, default_threads, resolve_backend, resolve_device_type

LAUNCH_TIME_VAR = "DDPKIT_LAUNCH_TIME"


def train(config: RunConfig | None = None, *, _clean_parent: bool = False, **overrides: Any) -> dict[str, Any]:
    """Train a task with the given settings and return rank 0's summary.

    Inside a launcher (torchrun, `ddpkit launch`, an srun task) this process is one worker;
    otherwise ddpkit starts the local workers itself. (`_clean_parent`: the caller, the CLI,
    guarantees this process has run no torch op, so workers may be forked from it.)
    """
    cfg = (config or RunConfig()).replace(**overrides) if overrides else (config or RunConfig())
    os.environ.setdefault(LAUNCH_TIME_VAR, repr(time.time()))
    from .worker import train_worker

    env = DistEnv.detect()
    if env.launcher != "single":
        return train_worker(cfg.as_dict())
    cfg = prepare_local_run(cfg)
    device_type = resolve_device_type(cfg.device)
    resolve_backend(cfg.backend, device_type)  # refuse nccl without GPU before starting anything
    nproc = resolve_nproc(cfg.nproc, device_type)
    if nproc == 1 and cfg.max_restarts == 0:
        return train_worker(cfg.as_dict())
    _check_task_exists(cfg.task)
    plan = LaunchPlan(
        nproc_per_node=nproc,
        max_restarts=cfg.max_restarts,
        start_method=start_method_for(cfg.start_method, device_type, _clean_parent),
        timeout=cfg.timeout,
        threads_per_process=cfg.threads or default_threads(nproc),
    )
    results = run_elastic(plan, train_worker, [cfg.as_dict()], verbose=cfg.verbose)
    return results[0]


def resolve_nproc(nproc: int | None, device_type: str) -> int:
    """'auto': one process per visible GPU; on CPU, 2 processes (so DDP really runs)."""
    if device_type == "cuda":
        ngpu = cuda_device_count()
        if nproc is None:
            return ngpu
        if nproc > ngpu:
            raise DdpkitError(f"--nproc {nproc} but only {ngpu} GPU(s) are visible: use at most one process per GPU (--nproc {ngpu})")
        return nproc
    return 2 if nproc is None else nproc


def prepare_local_run(cfg: RunConfig) -> RunConfig:
    """Pick the run directory and make sure starting (or resuming) there loses nothing."""
    run_dir = Path(cfg.run_dir) if cfg.run_dir else Path("runs") / f"{_task_slug(cfg.task)}-{time.strftime('%Y%m%d-%H%M%S')}"
    if cfg.resume:
        if not (run_dir / "checkpoints").is_dir():
            raise DdpkitError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}; run without --resume to start fresh")
    elif (run_dir / "checkpoints").exists() or (run_dir / "model.pt").exists():
        raise DdpkitError(f"{run_dir} already holds a run: pass --resume to continue it, or choose another --run-dir")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".ddpkit-write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise DdpkitError(f"cannot write to run directory {run_dir}: {e.strerror}; choose another --run-dir") from None
    return cfg.replace(run_dir=str(run_dir))


def _task_slug(task: str) -> str:
    name = task.rpartition(":")[2] if ":" in task else task
    base = Path(task.rpartition(":")[0]).stem if ":" in task else ""
    return "-".join(p for p in (base, name) if p) or "task"


def _check_task_exists(spec: str) -> None:
    """Fail in the launcher, before any worker starts, when the task cannot be found."""
    from .task import load_task_function

    load_task_function(spec)


def init(device: str = "auto", backend: str = "auto", timeout: float = 300.0, threads: int | None = None) -> Runtime:
    """For scripts with their own loop: join the job this process was started in (by
    `ddpkit launch`, torchrun or srun; alone otherwise) and return its Runtime.
    Use it as a context manager so the process group is always torn down."""
    return Runtime(DistEnv.detect(), device=device, backend=backend, timeout=timeout, threads=threads)


def launch(argv: list[str], nproc: int | None = None, max_restarts: int = 0, threads: int | None = None,
           timeout: float = 300.0, device: str = "auto") -> int:
    """Run `python ARGV...` in nproc local workers with torchrun's environment. Returns 0,
    or raises DdpkitError naming the failed rank (all other workers are stopped)."""
    import sys

    if not argv:
        raise DdpkitError("no script given: ddpkit launch [--nproc N] SCRIPT.py [ARGS...]")
    if argv[0] != "-m" and not os.path.isfile(argv[0]):
        raise DdpkitError(f"script {argv[0]!r} does not exist")
    device_type = resolve_device_type(device)
    n = resolve_nproc(nproc, device_type)
    plan = LaunchPlan(nproc_per_node=n, max_restarts=max_restarts, start_method="spawn", timeout=timeout,
                      threads_per_process=threads or default_threads(n))
    run_elastic(plan, sys.executable, ["-u", *argv])
    return 0
