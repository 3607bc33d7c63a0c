"""The Python API: `train()` for a whole run, `init()` for users who keep their own loop."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

from .checkpoint.world_mark import started_by_this_launch
from .config import RunConfig
from .config.processes import DEFAULT_TIMEOUT_S
from .environments import DistEnv
from .envvars import HANG_DIR_VAR, HANG_TIMEOUT_VAR, LAUNCH_ID_VAR, LAUNCH_TIME_VAR, TIMEOUT_VAR
from .errors import DdpkitError, Interrupted
from .launchers.elastic import run_elastic
from .launchers.plan import describe, make_launch_plan, resolve_nproc
from .launchers.report import RESUME_SCRIPT, RESUME_TRAIN
from .reporting.run_state import record_failure, stopped_by
from .reporting.sinks import end_abandoned_trackers
from .reporting.sinks.base import FAILED, STOPPED
from .runtime import default_threads, resolve_device_type
from .runtime.devices import choose_devices, cuda_device_count
from .session import Session
from .strategy_config import check

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
    backend = _backend(cfg, device_type, nproc)  # refuse nccl without GPU before starting anything
    plan = make_launch_plan(cfg, nproc, device_type, _clean_parent, cfg.threads or default_threads(nproc))
    if dry_run:
        _print_dry_run(cfg, plan, backend, nproc, device_type)
        return {"plan": plan}
    _check_strategy(cfg, device_type, nproc * plan.max_nodes)
    _check_task_exists(cfg)  # before the run directory is made: a task that cannot load leaves none
    cfg = cfg if cfg.run_dir else cfg.replace(run_dir=str(default_run_dir(cfg)))
    new = _missing_folders(cfg.run_dir)
    cfg = prepare_local_run(cfg)
    in_process = nproc == 1 and not cfg.multi_node and not cfg.rdzv_endpoint and cfg.max_restarts == 0
    with failure_recorded(cfg.run_dir, made=new):
        if in_process:
            return train_worker(cfg.as_dict())
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
    if dry_run:
        print(describe_worker(env, cfg))
        return {"plan": env.as_dict()}
    job = env.environment.job_id(os.environ)
    if job and not cfg.run_dir:
        cfg = cfg.replace(run_dir=f"runs/{_task_slug(cfg.task)}-job{job}")
    with failure_recorded(cfg.run_dir if env.is_main else None):
        return train_worker(cfg.as_dict())


def _print_dry_run(cfg: RunConfig, plan: Any, backend: str, nproc: int, device_type: str) -> None:
    """--dry-run: the launch plan and, unless --strategy ddp, what fsdp / auto would hold per rank
    (builds the task, trains nothing)."""
    print(describe(plan, backend if nproc * plan.max_nodes > 1 else "none (one process)", device_type))
    if cfg.strategy != "ddp":
        print(
            run_memory_plan(cfg, nproc * plan.max_nodes, plan.max_nodes, nproc, plan.start_method).format(
                cfg.task, cfg.strategy
            )
        )


def _after_signal(cfg: RunConfig, signum: int, saved_step: int | None = None) -> str:
    """What a run stopped by a signal left to continue from, and how (the launcher's line goes on).
    `saved_step`: this node's workers said they saved at that step (rank 0's summary.json, on
    another node, may not be written yet)."""
    from .reporting.run_state import run_state

    run_dir = Path(cfg.run_dir or ".")
    state = run_state(run_dir) if saved_step is None else {"state": "stopped", "summary": {"steps_done": saved_step}}
    if state["state"] == "stopped":
        steps = (state.get("summary") or {}).get("steps_done")
        at = f" at step {steps}" if steps is not None else ""
        return f" after saving a checkpoint{at}: continue with --resume --run-dir {run_dir}"
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


def _backend(cfg: RunConfig, device_type: str, local_procs: int) -> str:
    """The backend the workers will take: --backend, or NCCL on GPUs, gloo on CPUs and where
    ranks share a GPU (DDPKIT_SHARE_GPU=1: runtime/devices.py)."""
    ngpu = cuda_device_count() if device_type == "cuda" else 0
    return choose_devices(device_type, cfg.backend, local_procs, ngpu).backend


def describe_worker(env: DistEnv, cfg: RunConfig) -> str:
    return "\n".join(
        [
            f"ddpkit: started by {env.launcher} (dry run: nothing trained)",
            f"  rank {env.rank} of world size {env.world_size}; local rank {env.local_rank} of {env.local_world_size}; "
            f"node {env.node_rank} of {env.nnodes}",
            f"  master {env.master_addr}:{env.master_port}",
            f"  device {resolve_device_type(cfg.device)}, "
            f"backend {_backend(cfg, resolve_device_type(cfg.device), env.local_world_size)}",
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


def _check_strategy(cfg: RunConfig, device_type: str, nproc: int) -> None:
    """Refuse before any worker starts what the workers would refuse (`nproc`: the largest world)."""
    check(cfg.strategy_config(), nproc)
    cfg.batch_plan(nproc)
    if device_type == "cpu":  # (asking a GPU here would initialise CUDA in the launcher)
        from .strategies.precision import check_precision

        check_precision(cfg.precision, device_type)


def memory_plan(
    task: str = "wine",
    nproc: int | None = None,
    strategy: str = "auto",
    precision: str = "fp32",
    device_memory: int | str | None = None,
    seed: int = 0,
    device: str = "auto",
    local_nproc: int | None = None,
    task_args: dict[str, Any] | None = None,
    replicate: int | None = None,
    nnodes: int = 1,
    batch_size: int | None = None,
    activation_checkpointing: bool = False,
    cpu_allocator: str = "auto",
    accumulate: int = 1,
    global_batch_size: int | None = None,
    start_method: str = "spawn",
) -> Any:
    """The memory plan (strategies/memory.py: MemoryPlan) of `task` at `nproc` ranks: each
    strategy's state, each rank's peak (fixed cost, activations, rank 0's end of run) and auto's
    choice (.format(title, strategy) prints it, .choice() holds it). Builds the task here, on
    the meta device where it can; trains nothing. `local_nproc`: the ranks sharing one machine's
    RAM (default: all); `nnodes`: the nodes they span; `batch_size` (per process): the
    activations too (training/probe.py); `start_method` fork: measured in a fork, as the CLI's
    CPU workers start. The rest as `ddpkit train` takes it."""
    from .runtime.allocator import release_freed_memory, sized_to_memory
    from .strategies.memory import device_budget, make_plan

    device_type = resolve_device_type(device)
    n = resolve_nproc(nproc, device_type) if device_type == "cpu" or nproc is None else nproc
    cfg = _plan_request(task, n, strategy, precision, device_type, task_args, replicate)
    budget, where = device_budget(device_memory, device_type, local_nproc or n)
    # as the run will decide (runtime/allocator.py): released when sized to its memory
    release = device_type != "cpu" or release_freed_memory(cpu_allocator, sized_to_memory(strategy, device_memory))
    built, how, sharded, planning = _build_for_plan(cfg, seed)
    from .strategies.fsdp import default_blocks

    blocks = built.fsdp_blocks or default_blocks
    fixed = _fixed_cost(built, blocks, precision, device_type, start_method == "fork", (release, sharded, planning))
    activations = _probe(built, batch_size, built.checkpoint_blocks or blocks, precision)  # beside a fork's
    return make_plan(
        built.model,
        built.optimizer,
        n,
        precision,
        budget,
        where,
        blocks,
        strategy=strategy,
        replicate=replicate,
        nnodes=nnodes,
        activations=activations,
        checkpointing=activation_checkpointing,
        process=fixed(),
        built_how=how,
        built_on_meta=how.endswith("by the task"),
        accumulate=accumulate,
        fixed_global=global_batch_size is not None,
    )


def _plan_request(
    task: str, n: int, strategy: str, precision: str, device_type: str, task_args: Any, replicate: int | None
) -> RunConfig:
    """The plan's request as a RunConfig, refused as `train` would refuse it (fp16 on a CPU; bf16
    is planned anywhere: autocast emulates it where the CPU lacks it)."""
    from .strategies.precision import check_precision
    from .strategy_config import StrategyConfig

    if precision == "fp16":
        check_precision(precision, device_type)
    check(StrategyConfig(name=strategy, replicate=replicate), n)
    return RunConfig(task=task, nproc=n, strategy=strategy, precision=precision, task_args=task_args or {})


def run_memory_plan(cfg: RunConfig, nproc: int, nnodes: int, local_nproc: int, start_method: str) -> Any:
    """memory_plan() of the run `cfg` asks for, at `nproc` ranks over `nnodes` nodes
    (`local_nproc` on each), its workers started by `start_method`."""
    return memory_plan(
        cfg.task,
        nproc,
        cfg.strategy,
        cfg.precision,
        cfg.device_memory,
        cfg.seed,
        cfg.device,
        local_nproc=local_nproc,
        task_args=cfg.task_args,
        replicate=cfg.replicate,
        nnodes=nnodes,
        batch_size=cfg.batch_size,
        activation_checkpointing=cfg.activation_checkpointing,
        cpu_allocator=cfg.cpu_allocator,
        accumulate=cfg.accumulate,
        global_batch_size=cfg.global_batch_size,
        start_method=start_method,
    )


def _fixed_cost(
    built: Any, blocks: Any, precision: str, device_type: str, forked: bool, how: tuple
) -> Callable[[], Any]:
    """A worker's fixed cost (strategies/memory.py: measure_process, `how`: its release, sharded
    and beside), measured as the workers will start: for forked ones on a CPU in a fork of this
    process, which holds this process's heap but only the code it runs itself. Returns what
    waits for it: the fork measures while this process goes on."""
    from .strategies.memory import ProcessCost, measure_process

    measure = lambda: measure_process(built.model, device_type, *how)  # noqa: E731
    if not forked or device_type != "cpu":
        here = measure()
        return lambda: here
    wait = _in_a_fork(lambda: dataclasses.asdict((_as_a_worker(built, blocks, precision), measure())[1]))

    def result() -> Any:
        got = wait()
        return ProcessCost(**got) if got else measure()

    return result


def _as_a_worker(built: Any, blocks: Any, precision: str) -> None:
    """What a worker does before its first step that loads code and lazily made buffers, on
    nothing large: a forward and backward of one sample, an optimizer step on a small tensor,
    a process group of one (gloo) and one all-reduce in it."""
    import torch
    import torch.distributed as dist

    from .strategies.memory import optimizer_state_per_param

    _probe(built, 1, blocks, precision)
    optimizer_state_per_param(built.optimizer)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(8))
    finally:
        dist.destroy_process_group()


def _in_a_fork(measure: Callable[[], Any], timeout: float = 60.0) -> Callable[[], Any]:
    """Starts `measure()` in a forked child of this process; returns what waits for its result
    (plain data, as JSON), or None when the child fails or takes longer than `timeout` seconds
    (then it is killed). The child runs torch on one thread: a fork inherits no OpenMP pool it
    could use."""
    import json
    import select
    import signal as signals

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: measure, hand it over, leave without running anything of the parent's
        try:
            os.close(read)
            import torch

            torch.set_num_threads(1)
            with os.fdopen(write, "w") as out:
                json.dump(measure(), out)
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + timeout

    def wait() -> Any:
        data = b""
        with os.fdopen(read, "rb", buffering=0) as got:
            while (left := deadline - time.monotonic()) > 0 and select.select([got], [], [], left)[0]:
                chunk = got.read(65536)
                if not chunk:
                    break
                data += chunk
            else:
                os.kill(pid, signals.SIGKILL)
        os.waitpid(pid, 0)
        try:
            return json.loads(data)
        except ValueError:
            return None

    return wait


def _probe(built: Any, batch_size: int | None, blocks: Any, precision: str) -> Any:
    """The activations of a micro-batch of `batch_size` (training/probe.py), when one is given."""
    if batch_size is None:
        return None
    from .training.probe import estimate_activations

    return estimate_activations(built, batch_size, blocks, precision)


def _build_for_plan(cfg: RunConfig, seed: int) -> tuple[Any, str, int, int]:
    """The task as the plan sees it, how it was built, what FSDP's modules cost, and the bytes
    this process holds that a worker does not: its parameters on the meta device (fast, no memory;
    what torch's meta kernels load is measured by a first small build), or eagerly where a meta build
    fails (a task that reads its weights' values)."""
    import torch
    from torch import nn

    from . import worker  # noqa: F401  (what a worker imports: its cost is measured with the rest)
    from .runtime.allocator import resident_bytes
    from .strategies.materialize import parameters_on_meta
    from .strategies.memory import load_what_every_worker_loads, sharding_import_cost
    from .task import build_task
    from .worker import seed_everything

    load_what_every_worker_loads()
    sharded = sharding_import_cost()
    before = resident_bytes()
    with parameters_on_meta():
        nn.Embedding(8, 8)(torch.zeros(2, dtype=torch.long, device="meta")).sum()  # torch's meta machinery
    planning = max(0, resident_bytes() - before)
    seed_everything(seed)
    try:
        with parameters_on_meta() as moved:
            built = build_task(cfg.task, cfg)
        by_task = not any(id(p) in moved for p in built.model.parameters())
        return built, "; built on the meta device" + (" by the task" if by_task else ""), sharded, planning
    except DdpkitError:
        raise
    except Exception as e:  # the plan still stands on an eager build
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    seed_everything(seed)
    return build_task(cfg.task, cfg), f"; built eagerly (on the meta device: {reason})", sharded, planning


def _task_slug(task: str) -> str:
    name = task.rpartition(":")[2] if ":" in task else task
    base = Path(task.rpartition(":")[0]).stem if ":" in task else ""
    return "-".join(p for p in (base, name) if p) or "task"


def _check_task_exists(cfg: RunConfig) -> None:
    """Fail in the launcher, before any worker starts, when the task cannot be found or does
    not take the --task-arg names."""
    from .task import check_task_call, load_task_function

    check_task_call(cfg.task, load_task_function(cfg.task), cfg.task_args)


def init(
    device: str = "auto", backend: str = "auto", timeout: float | None = None, threads: int | None = None
) -> Session:
    """For scripts with their own loop: join the job this process was started in (by
    `ddpkit launch`, torchrun or srun; alone otherwise) and return its Session (session.py).
    Use it as a context manager so the process group is always torn down. `timeout`: seconds a
    collective may wait (default: `ddpkit launch --timeout`, else DEFAULT_TIMEOUT_S)."""
    if timeout is None:
        timeout = float(os.environ.get(TIMEOUT_VAR) or DEFAULT_TIMEOUT_S)
    return Session(DistEnv.detect_worker(), device=device, backend=backend, timeout=timeout, threads=threads)


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
        print(describe(plan, _backend(cfg, device_type, n), device_type))
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
