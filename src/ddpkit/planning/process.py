"""What a process measures of itself for the memory plan and a run's report: its device's
memory budget, the optimizer's state per parameter element (stepping the task's optimizer once
on a small probe tensor: Adam 8 bytes, SGD with momentum 4, plain SGD 0), the fixed cost of a
worker (the interpreter, torch, the modules, the task's data), the state a rank really holds,
and its peak."""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config.values import format_bytes, parse_memory

ASSUMED_OPTIMIZER_BYTES = 8.0  # Adam's two fp32 moments, when the optimizer cannot be probed


def detect_device_memory(device_type: str, local_procs: int) -> tuple[int, str]:
    """This rank's memory budget: the GPU's, or the machine's RAM shared by the local processes."""
    if device_type == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return int(props.total_memory), f"{props.name}"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:  # a container's limit, when it has one
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    procs = max(1, local_procs)
    share, where = total // procs, f"CPU RAM {format_bytes(total)}" + (f" / {procs} processes" if procs > 1 else "")
    limit = process_memory_limit()
    if limit is not None and limit < share:  # each process's own limit (prlimit --data / --as)
        return limit, f"this process's memory limit {format_bytes(limit)}"
    return share, where


def process_memory_limit() -> int | None:
    """The smaller of this process's RLIMIT_DATA and RLIMIT_AS (None: unlimited): what a worker
    may allocate whatever the machine has."""
    limits = [resource.getrlimit(r)[0] for r in (resource.RLIMIT_DATA, resource.RLIMIT_AS)]
    finite = [x for x in limits if x != resource.RLIM_INFINITY and x > 0]
    return min(finite) if finite else None


def device_budget(given: int | str | None, device_type: str, sharing: int) -> tuple[int, str]:
    """The memory per rank a plan assumes, and where it comes from: the size given
    (--device-memory), else what this machine's device has (a CPU's RAM over the `sharing`
    ranks on it)."""
    budget = parse_memory(given)
    return (budget, "given") if budget is not None else detect_device_memory(device_type, sharing)


def optimizer_state_per_param(spec: Any) -> tuple[str, float, bool]:
    """(name, bytes of optimizer state per parameter element, measured?) of the task's optimizer."""
    name = type(spec).__name__ if isinstance(spec, torch.optim.Optimizer) else "optimizer"
    probe = nn.Parameter(torch.zeros(64))
    try:
        opt = type(spec)([probe], **spec.defaults) if isinstance(spec, torch.optim.Optimizer) else spec([probe])
        name = type(opt).__name__
        probe.grad = torch.full_like(probe, 1e-3)
        opt.step()
        size = sum(
            t.numel() * t.element_size()
            for s in opt.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.numel() == probe.numel()
        )
        return name, size / probe.numel(), True
    except Exception:
        return name, ASSUMED_OPTIMIZER_BYTES, False


@dataclass(frozen=True)
class ProcessCost:
    """What a worker holds besides the model's state and the activations (measured, not assumed).

    fixed: its resident memory before the model: the interpreter, torch and the modules a
    worker imports, the task's data, the process group (on a GPU: the CUDA context and what
    else the device already holds). sharded_imports: what FSDP's modules add to it (only a
    sharded run imports them). release: on a CPU, the workers hand freed blocks back to the
    system (--cpu-allocator release, runtime/allocator.py), so their peak is what is live;
    otherwise glibc keeps them and a peak 1.1-1.5x the plan's is usual."""

    fixed: int = 0
    sharded_imports: int = 0
    source: str = "not measured"
    release: bool = True

    def of(self, sharded: bool) -> int:
        return self.fixed + (self.sharded_imports if sharded else 0)


def load_what_every_worker_loads() -> None:
    """Import what every worker has loaded by its first optimizer step (DDP's constructor and
    the optimizer's first step import torch._dynamo: ~70 MB of sympy and fx), so that it is
    measured as part of the fixed cost, in a worker and in the plan alike."""
    import torch._dynamo  # noqa: F401


def sharding_import_cost() -> int:
    """What importing FSDP's modules adds to this process's resident set (0 once imported)."""
    from ..runtime.allocator import resident_bytes

    if "ddpkit.strategies.fsdp" in sys.modules:
        return 0
    before = resident_bytes()
    from ..strategies import fsdp  # noqa: F401

    return max(0, resident_bytes() - before)


def measure_process(
    model: nn.Module, device_type: str, release: bool, sharded: int = 0, beside: int = 0
) -> ProcessCost:
    """This process's fixed cost now, with `model` built: on a CPU its resident set less the
    model's own tensors (what remains is torch, the modules, the task's data, the process
    group), less `sharded` (what FSDP's modules added: sharding_import_cost, counted for a
    sharded run only) and `beside` (what this process holds that a worker would not: the plan's
    meta build); on a GPU what the device already holds (the CUDA context, other processes).
    `release`: whether freed memory goes back to the system (runtime/allocator.py)."""
    if device_type == "cuda":
        free, total = torch.cuda.mem_get_info()
        return ProcessCost(total - free, 0, "measured: the CUDA context and what the device already holds", True)
    from ..runtime.allocator import resident_bytes

    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if not t.is_meta}
    own = sum(t.numel() * t.element_size() for t in tensors.values())
    fixed = max(0, resident_bytes() - own - beside - sharded)
    return ProcessCost(fixed, sharded, "measured: torch, the modules, the task's data; + FSDP's modules", release)


def local_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What this rank really holds of the model's state (its shards under FSDP). Gradients
    have the parameters' shapes, so they count as much as the parameters."""
    params = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    optim = sum(
        _local(t).numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    return {"params": params, "grads": params, "optimizer": optim, "total": 2 * params + optim}


def state_bytes_at_start(model: nn.Module, optimizer: torch.optim.Optimizer, spec: Any) -> dict[str, int]:
    """local_state_bytes before the first optimizer step: an optimizer that makes its state at its
    first step (Adam) holds none yet, so its state is counted per parameter element as the plan
    does (optimizer_state_per_param on the task's optimizer `spec`)."""
    state = local_state_bytes(model, optimizer)
    if state["optimizer"] == 0:
        per_element = optimizer_state_per_param(spec)[1]
        elements = sum(_local(p).numel() for p in model.parameters() if p.requires_grad)
        state["optimizer"] = int(per_element * elements)
        state["total"] = 2 * state["params"] + state["optimizer"]
    return state


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def reset_peak_memory(device: torch.device) -> None:
    """Count this run's peak only (a second run in one process must not report the first's)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """This process's peak: CUDA max allocated on a GPU, the resident set's peak on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda max allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), "peak resident set"
