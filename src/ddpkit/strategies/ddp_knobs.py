"""Performance knobs of a DDP run, kept apart from the strategy (ddp.py): DDP constructor
options, gradient compression hooks, fused optimizers, torch.compile. (Accumulation with
no_sync is the Strategy's no_sync, driven by training/step.py.)

What each one changes in the result (tests/distributed/test_knobs.py checks these;
--grad-sync, the shared-memory all-reduce, lives in grad_sync.py and test_grad_sync.py):
  --grad-sync shm (auto's choice  2 ranks: bit-identical to gloo; 3+: another summation
  for CPU ranks on one machine)   order (equal within 1e-6)
  --bucket-mb, --static-graph     nothing: the same sums in the same order (equal within
                                  1e-6; bucket boundaries may change the rounding)
  --fused-optimizer on            Adam/AdamW/SGD's fused kernel: same math, another
                                  rounding (close: ~1e-6 relative after 100 Wine epochs)
  --accumulate K                  batch b x K micro-batches == batch K*b per optimizer step
                                  (float rounding only: ~1e-6)
  --grad-compression bf16|fp16    gradients are all-reduced in 16 bits: close, not equal
  --grad-compression powersgd     low-rank (rank 4) gradients with error feedback: an
                                  approximation that converges differently
  --compile                       inductor kernels: another rounding (close); aot_eager
                                  (no C++ compiler): the eager kernels (compiling.py)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config.performance import GRAD_COMPRESSIONS as COMPRESSIONS
from ..errors import DdpkitError
from ..parallel.spec import StrategyConfig
from .optimizers import rebuild_optimizer

_FUSABLE = ("Adam", "AdamW", "SGD")


def ddp_options(config: StrategyConfig, backend: str = "gloo") -> dict[str, Any]:
    """DistributedDataParallel keyword arguments from the run's settings."""
    options: dict[str, Any] = {}
    if config.bucket_mb:
        options["bucket_cap_mb"] = float(config.bucket_mb)
    if config.grad_compression == "powersgd" and backend != "nccl":
        # PowerSGD's hook runs several all-reduces per bucket from callbacks; with gloo, the
        # hooks of two buckets can interleave them differently on each rank (a collective
        # mismatch, seen on a 9.5M MLP). One bucket keeps them in order, at the cost of overlap.
        options["bucket_cap_mb"] = 1 << 20
    if config.static_graph:
        options["static_graph"] = True
    return options


def register_compression(ddp_model: nn.Module, compression: str) -> None:
    """Install DDP's communication hook for --grad-compression (no-op for 'none' or one process)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if compression == "none" or not isinstance(ddp_model, DDP):
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if compression == "bf16":
        # torch's bf16_compress_hook refuses anything but NCCL; gloo all-reduces bf16 fine
        ddp_model.register_comm_hook(None, _bf16_hook() if not _is_nccl() else default_hooks.bf16_compress_hook)
    elif compression == "fp16":
        ddp_model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif compression == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2, min_compression_rate=2
        )
        ddp_model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        raise DdpkitError(f"--grad-compression must be one of {', '.join(COMPRESSIONS)}, got {compression!r}")


def _is_nccl() -> bool:
    import torch.distributed as dist

    return dist.get_backend() == "nccl"


def _bf16_hook() -> Any:
    """torch's bf16 compression for any backend (gloo all-reduces bfloat16)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def bf16_hook(process_group, bucket):  # type: ignore[no-untyped-def]  (DDP checks the annotations)
        return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)

    bf16_hook.__annotations__ = {}
    return bf16_hook


def maybe_compile(model: nn.Module, backend: str | None) -> nn.Module:
    """torch.compile the (DDP-wrapped) model with `backend` (None: not compiled; compiling.py
    chooses it): DDP's optimizer splits the graph at bucket boundaries, so communication still
    overlaps backward. unwrap() sees through it. (With activation checkpointing, or under FSDP,
    each block's forward is compiled instead: Strategy.compile_blocks.)"""
    if backend is None:
        return model
    return torch.compile(model, backend=backend)  # type: ignore[return-value]


def fuse_optimizer(optimizer: torch.optim.Optimizer, mode: str, device: torch.device) -> torch.optim.Optimizer:
    """With mode 'on', or 'auto' on a GPU where the task chose neither `fused` nor `foreach`,
    rebuild a fresh torch Adam/AdamW/SGD with its fused kernel (one pass over all parameters per
    step instead of one kernel per tensor), same param groups and hyper-parameters. Anything
    else is returned as it is (is_fused() says which ran)."""
    if mode == "off" or (mode == "auto" and (device.type != "cuda" or _task_chose(optimizer))):
        return optimizer
    cls = type(optimizer)
    if cls.__module__.split(".")[:2] != ["torch", "optim"] or cls.__name__ not in _FUSABLE:
        if mode == "on":
            print(f"ddpkit: --fused-optimizer on: {cls.__name__} has no fused kernel here; left as it is", flush=True)
        return optimizer
    if optimizer.state or optimizer.defaults.get("differentiable") or optimizer.defaults.get("fused"):
        return optimizer
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params):
        return optimizer
    return rebuild_optimizer(optimizer, fused=True, foreach=None)


def _task_chose(optimizer: torch.optim.Optimizer) -> bool:
    """The task set `fused` or `foreach` itself (in its defaults or any param group): auto keeps its choice."""
    return any(
        settings.get(key) is not None
        for settings in (optimizer.defaults, *optimizer.param_groups)
        for key in ("fused", "foreach")
    )


def is_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer that runs steps with a fused kernel (the summary's fused_optimizer)."""
    return bool(optimizer.defaults.get("fused")) or any(g.get("fused") for g in optimizer.param_groups)
