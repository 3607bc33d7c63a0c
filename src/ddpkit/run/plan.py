"""The memory plan of a run as `ddpkit plan`, `--dry-run` and `ddpkit.memory_plan` ask for it: the
task built as the workers would build it (on the meta device where it can), a worker's fixed cost
measured as the workers will start, and the plan (planning/memory.py) made from them."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

from ..config import RunConfig
from ..errors import DdpkitError
from ..launchers.plan import resolve_nproc
from ..parallel.spec import check
from ..runtime import resolve_device_type


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
    """The memory plan (planning/memory.py: MemoryPlan) of `task` at `nproc` ranks: each
    strategy's state, each rank's peak (fixed cost, activations, rank 0's end of run) and auto's
    choice (.format(title, strategy) prints it, .choice() holds it). Builds the task here, on
    the meta device where it can; trains nothing. `local_nproc`: the ranks sharing one machine's
    RAM (default: all); `nnodes`: the nodes they span; `batch_size` (per process): the
    activations too (training/probe.py); `start_method` fork: measured in a fork, as the CLI's
    CPU workers start. The rest as `ddpkit train` takes it."""
    from ..planning import memory, process
    from ..runtime.allocator import release_freed_memory, sized_to_memory

    device_type = resolve_device_type(device)
    n = resolve_nproc(nproc, device_type) if device_type == "cpu" or nproc is None else nproc
    cfg = _plan_request(task, n, strategy, precision, device_type, task_args, replicate)
    budget, where = process.device_budget(device_memory, device_type, local_nproc or n)
    # as the run will decide (runtime/allocator.py): released when sized to its memory
    release = device_type != "cpu" or release_freed_memory(cpu_allocator, sized_to_memory(strategy, device_memory))
    built, how, sharded, planning = _build_for_plan(cfg, seed)
    from ..strategies.fsdp import default_blocks  # after _build_for_plan has measured what it costs

    blocks = built.fsdp_blocks or default_blocks
    fixed = _fixed_cost(built, blocks, precision, device_type, start_method == "fork", (release, sharded, planning))
    activations = _probe(built, batch_size, built.checkpoint_blocks or blocks, precision)  # beside a fork's
    return memory.make_plan(
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
    from ..parallel.spec import StrategyConfig
    from ..strategies.precision import check_precision

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
        batch_size=None if cfg.batch_size == "auto" else cfg.batch_size,  # auto: chosen in the run
        activation_checkpointing=cfg.activation_checkpointing,
        cpu_allocator=cfg.cpu_allocator,
        accumulate=cfg.accumulate,
        global_batch_size=cfg.global_batch_size,
        start_method=start_method,
    )


def _fixed_cost(
    built: Any, blocks: Any, precision: str, device_type: str, forked: bool, how: tuple
) -> Callable[[], Any]:
    """A worker's fixed cost (planning/process.py: measure_process, `how`: its release, sharded
    and beside), measured as the workers will start: for forked ones on a CPU in a fork of this
    process, which holds this process's heap but only the code it runs itself. Returns what
    waits for it: the fork measures while this process goes on."""
    from ..planning.process import ProcessCost, measure_process

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

    from ..planning.process import optimizer_state_per_param

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
    from ..training.probe import estimate_activations

    return estimate_activations(built, batch_size, blocks, precision)


def _build_for_plan(cfg: RunConfig, seed: int) -> tuple[Any, str, int, int]:
    """The task as the plan sees it, how it was built, what FSDP's modules cost, and the bytes
    this process holds that a worker does not: its parameters on the meta device (fast, no memory;
    what torch's meta kernels load is measured by a first small build), or eagerly where a meta build
    fails (a task that reads its weights' values)."""
    import torch
    from torch import nn

    from ..planning.process import load_what_every_worker_loads, sharding_import_cost
    from ..runtime.allocator import resident_bytes
    from ..strategies.materialize import parameters_on_meta
    from ..task import build_task
    from . import worker  # noqa: F401  (what a worker imports: its cost is measured with the rest)
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
