"""`--batch-size auto` in the workers: the largest micro-batch the memory plan says fits, chosen
once on rank 0 and broadcast, before the data loader is built.

The activations are probed once (training/probe.py, linear in the batch), the plan is made for
the run's strategy, and the peak (planning/peak.py: Peak) is searched for the largest micro-batch
within FIT_FRACTION of the device. The search is bounded by the device's memory (on a CPU: the
machine's RAM over the local processes, a container's limit or this process's RLIMIT_DATA /
RLIMIT_AS: planning/process.py), by each process's share of the training set (or of
--global-batch-size, which then keeps its global batch through accumulation) and by MAX_BATCH.
One measured forward and backward at the chosen size confirms it: an allocation that fails, or
a measured peak over the budget, halves it, and the line says so. A resumed run keeps the
micro-batch its config.json recorded: a different one would change its results.
"""

from __future__ import annotations

import gc
import json
import resource
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import RunConfig, check_batch_auto
from ..config.values import format_bytes
from ..errors import DdpkitError
from ..planning.memory import make_plan
from ..planning.process import ProcessCost, device_budget
from ..runtime.group import Runtime
from ..strategies.choice import FIT_FRACTION
from ..task import Task
from .batches import compute_loss
from .probe import estimate_activations

MAX_BATCH = 65536  # samples per micro-batch: beyond it a data set of tiny samples would search on


def largest_fitting(peak: Callable[[int], int], budget: float, cap: int) -> int | None:
    """The largest micro-batch b in [1, cap] whose `peak(b)` is within `budget` (the peak grows
    with the batch, so a bisection); None when even one sample does not fit."""
    if peak(1) > budget:
        return None
    lo, hi = 1, max(1, cap)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if peak(mid) <= budget else (lo, mid - 1)
    return lo


def search_cap(cfg: RunConfig, task: Task, data_parallel: int) -> int:
    """What bounds the search besides memory: each process's share of the training set (or of
    --global-batch-size) and MAX_BATCH."""
    cap = MAX_BATCH
    try:
        cap = min(cap, max(1, len(task.train_set) // data_parallel))
    except TypeError:  # an iterable data set: no size
        pass
    if cfg.global_batch_size is not None:
        cap = min(cap, -(-cfg.global_batch_size // data_parallel))
    return cap


def kept_from_resume(cfg: RunConfig, run_dir: Path) -> int | None:
    """The micro-batch a resumed run chose at its start (its config.json), or None."""
    path = run_dir / "config.json"
    if not (cfg.resume or cfg.auto_resume) or not path.is_file():
        return None
    value = json.loads(path.read_text()).get("batch_size")
    return value if isinstance(value, int) else None


def resolve_batch_auto(
    cfg: RunConfig, rt: Runtime, task: Task, process: ProcessCost, run_dir: Path
) -> tuple[RunConfig, str | None]:
    """`cfg` with the micro-batch `--batch-size auto` picks (unchanged otherwise), and the line
    that says it (None: not auto); every rank takes rank 0's answer."""
    if cfg.batch_size != "auto":
        return cfg, None
    check_batch_auto(cfg)
    budget, where = device_budget(cfg.device_memory, rt.device.type, rt.env.local_world_size)
    budget = min(rt.all_gather_object(budget)) if rt.distributed else budget  # the smallest device decides
    answer: Any = None
    if rt.is_main:
        answer = _decide(cfg, rt, task, process, run_dir, budget, where)
    batch, line = rt.broadcast_object(answer) if rt.distributed else answer
    if batch is None:
        raise DdpkitError(line)
    if not cfg.quiet:
        rt.print(f"ddpkit: --batch-size auto: {line}")
    return cfg.replace(batch_size=batch), f"--batch-size auto: {line}"


def _decide(
    cfg: RunConfig, rt: Runtime, task: Task, process: ProcessCost, run_dir: Path, budget: int, where: str
) -> tuple[int | None, str]:
    """(micro-batch, the line) on rank 0: kept from the resumed run, else searched and measured."""
    kept = kept_from_resume(cfg, run_dir)
    if kept is not None:
        return kept, f"{kept} per process, kept from the run being resumed"
    from ..strategies.fsdp import default_blocks
    from .auto import _untouched

    blocks = task.fsdp_blocks or default_blocks
    with _untouched(task.model):
        activations = estimate_activations(task, 1, task.checkpoint_blocks or blocks, cfg.precision)
    if isinstance(activations, str):
        return None, f"--batch-size auto: the activations could not be measured ({activations}); give --batch-size"
    plan = make_plan(
        task.model, task.optimizer, rt.world_size, cfg.precision, budget, where, blocks,
        strategy=cfg.strategy, nnodes=rt.env.nnodes, activations=activations,
        checkpointing=cfg.activation_checkpointing, process=process,
    )  # fmt: skip
    dp = rt.world_size // (cfg.tp * cfg.pp)
    cap = search_cap(cfg, task, dp)
    limit = FIT_FRACTION * budget
    batch = largest_fitting(lambda b: plan.peak(cfg.strategy, None, b).total, limit, cap)
    if batch is None:
        need = format_bytes(plan.peak(cfg.strategy, None, 1).total)
        return None, (
            f"--batch-size auto: not even 1 sample per process fits: {need} per rank, more than "
            f"{format_bytes(limit)} ({FIT_FRACTION:.0%} of {format_bytes(budget)}, {where}); see ddpkit plan"
        )
    bound = _bound(cfg, batch, cap, dp)
    planned = plan.peak(cfg.strategy, None, batch).total
    with _untouched(task.model):
        batch, measured, halved = _confirmed(task, batch, limit)
    said = f"{batch} per process (bounded by {bound}; planned peak {format_bytes(planned)} of {format_bytes(limit)}"
    said += f", measured {format_bytes(measured)} in one step)" if measured else ")"
    if halved:
        said += f"; halved {halved} time(s): the measured step did not fit"
    return batch, said


def _bound(cfg: RunConfig, batch: int, cap: int, dp: int) -> str:
    """What stopped the search: memory, or which of its other bounds."""
    if batch < cap:
        return "memory"
    if cfg.global_batch_size is not None and cap == -(-cfg.global_batch_size // dp):
        return "its share of --global-batch-size"
    return "the data set" if cap < MAX_BATCH else f"the cap {MAX_BATCH}"


def _confirmed(task: Task, batch: int, limit: float) -> tuple[int, int, int]:
    """One forward and backward at `batch` samples on the model as it is (its gradients cleared
    after): (the batch that ran within `limit`, its measured peak, times halved)."""
    halved = 0
    while True:
        try:
            measured = _one_step(task, batch)
        except (MemoryError, RuntimeError) as e:
            if "alloc" not in str(e) and "memory" not in str(e) and not isinstance(e, MemoryError):
                raise
            measured = None
        if (measured is not None and measured <= limit) or batch == 1:
            return batch, measured or 0, halved
        batch, halved = max(1, batch // 2), halved + 1


def _one_step(task: Task, batch: int) -> int:
    """The peak of one micro-batch's forward and backward: on a GPU what torch allocated (the
    CUDA context not counted), on a CPU the process's resident high-water mark (since its start,
    so at least the step's)."""
    model = task.model
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    samples = [task.train_set[i % len(task.train_set)] for i in range(batch)]
    from torch.utils.data import default_collate

    was_training = model.training
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    try:
        model.train()
        with torch.enable_grad():
            loss = compute_loss(model, default_collate(samples), batch, task.loss_fn, task.step, device)
            if loss.value is not None:
                loss.value.backward()
        del loss
    finally:
        model.train(was_training)
        for p in model.parameters():
            p.grad = None
        gc.collect()
    if cuda:
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
