"""`ddpkit launch`: a user's own script in every worker of this node, with torchrun's environment
and ddpkit's bootstrap (its timeout, the hang watchdog, the name of a teardown abort)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..environments import DistEnv
from ..errors import DdpkitError
from ..runtime import default_threads, resolve_device_type
from ..runtime.devices import workers_backend
from ..util.envvars import HANG_DIR_VAR, HANG_TIMEOUT_VAR, TIMEOUT_VAR
from .elastic import run_elastic
from .plan import describe, make_launch_plan, resolve_nproc
from .report import RESUME_SCRIPT


def launch(
    argv: list[str],
    config: RunConfig | None = None,
    *,
    dry_run: bool = False,
    no_python: bool = False,
    agent_options: dict[str, Any] | None = None,
) -> int:
    """Run `python ARGV...` in this node's workers with torchrun's environment (the process
    flags of `config`: nproc, nodes, rendezvous, restarts, threads, timeout). Returns 0, or
    raises DdpkitError naming the failed rank (all other workers are stopped)."""
    import shutil

    cfg = config or RunConfig()
    _check_launch(argv, no_python)
    device_type = resolve_device_type(cfg.device)
    n = resolve_nproc(cfg.nproc, device_type)
    start = cfg.start_method if cfg.start_method != "auto" else "spawn"
    # several local workers: every stream not redirected goes through the agent's tail, whole lines with their rank
    tee = cfg.tee or (str(3 & ~int(cfg.redirects)) if n > 1 and cfg.redirects.isdigit() else "0")
    plan = make_launch_plan(
        cfg.replace(start_method=start, tee=tee), n, device_type, False, cfg.threads or default_threads(n)
    )
    if dry_run:
        print(describe(plan, workers_backend(cfg.backend, device_type, n), device_type))
        return 0
    if no_python:  # torchrun --no-python: the executable itself in every worker (no guard can go in)
        run_elastic(
            plan,
            shutil.which(argv[0]) or argv[0],
            argv[1:],
            verbose=cfg.verbose,
            agent_options=agent_options,
            restarted=RESUME_SCRIPT,
        )
        return 0
    _run_bootstrapped(plan, argv, cfg, agent_options)
    return 0


def _check_launch(argv: list[str], no_python: bool) -> None:
    """Refuse a launch with no script, a missing one, or from a process that is already one
    worker of a job of several (a launch in each would start that many independent jobs)."""
    import shutil

    if not argv:
        raise DdpkitError("no script given: ddpkit launch [--nproc N] SCRIPT.py [ARGS...]")
    if argv[0] != "-m" and not os.path.isfile(argv[0]) and not (no_python and shutil.which(argv[0])):
        raise DdpkitError(f"script {argv[0]!r} does not exist")
    env = DistEnv.detect()
    # each would start a separate job of its own
    if not env.environment.launch_inside and env.world_size > 1:
        raise DdpkitError(
            f"{env.environment.starter} already started this job's {env.world_size} processes, each meant "
            f"to be one worker; `ddpkit launch` in each would start {env.world_size} independent jobs: "
            "run the script itself "
            "(e.g. `mpirun -np N python script.py`), which joins the job with ddpkit.init()"
        )


def _run_bootstrapped(plan: Any, argv: list[str], cfg: RunConfig, agent_options: dict[str, Any] | None) -> None:
    """Every worker runs the script through ddpkit's bootstrap (launchers/bootstrap.py): --timeout
    for its process group, the hang watchdog and report, the name of a teardown abort after it returned."""
    import sys

    hang_dir = (Path(cfg.log_dir) if cfg.log_dir else Path.cwd()).resolve() / f"ddpkit-hang-{plan.rdzv_id}"
    guard = {TIMEOUT_VAR: repr(float(cfg.timeout)), HANG_DIR_VAR: str(hang_dir)}
    if cfg.hang_timeout is not None:
        guard[HANG_TIMEOUT_VAR] = repr(float(cfg.hang_timeout))
    run_elastic(
        plan,
        sys.executable,
        ["-u", "-m", "ddpkit.launchers.bootstrap", *argv],
        env=guard,
        verbose=cfg.verbose,
        agent_options=agent_options,
        hang_dir=hang_dir,
        restarted=RESUME_SCRIPT,
    )
