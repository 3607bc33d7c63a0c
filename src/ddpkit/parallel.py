"""How the model is parallelised: one process (as is), DDP, or FSDP; and in what precision.

The trainer talks to a Strategy only: `setup` (wrap the model, build the optimizer over
the parameters it will step), `autocast`, `full_state_dict` (the plain weights, gathered
when sharded), `load_full` / `load_sharded` (resume from either kind of checkpoint) and,
when `sharded`, `save_checkpoint` (every rank writes its shard; otherwise the trainer's
rank-0 file). DdpStrategy is here, FsdpStrategy in fsdp.py; `make_strategy` picks one
(`auto`: the memory plan decides).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .config import FSDP_NEEDS_TWO, PRECISIONS, check_no_ddp_only_flags
from .errors import DdpkitError
from .runtime import Runtime


def wrap_model(model: nn.Module, rt: Runtime, grad_sync: str = "auto", **ddp_options: Any) -> nn.Module:
    """Move the model to this rank's device and wrap it in DDP when there are several ranks.
    DDP broadcasts rank 0's parameters, so every replica starts identical.

    grad_sync: 'auto' all-reduces gradients through shared memory when every rank is on
    this machine's CPUs (shm_allreduce.py; bit-identical to gloo with 2 ranks), else with
    the backend; 'backend' always uses the backend; 'shm' insists on shared memory and
    raises when it cannot apply. A comm hook registered later on the model takes over.
    """
    model = model.to(rt.device)
    if not rt.env.distributed:
        return model
    options: dict[str, Any] = {"gradient_as_bucket_view": True}
    options.update(ddp_options)
    if rt.device.type == "cuda":
        options.setdefault("device_ids", [rt.device.index])
    ddp = DDP(model, **options)
    from .shm_allreduce import install

    state = install(ddp, grad_sync, rt.env.local_world_size, rt.backend, rt.device.type, say=rt.print, timeout=rt.timeout)
    ddp._ddpkit_grad_sync = "shm" if state is not None else rt.backend  # type: ignore[assignment]  (for summaries)
    return ddp


def grad_sync_used(model: nn.Module) -> str:
    """How this model's gradients are all-reduced: 'shm', the backend's name, or 'none'
    (one process, or a model ddpkit did not wrap in DDP: FSDP reduce-scatters by itself)."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "_ddpkit_grad_sync", "none")


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside any wrapper (state_dict keys without `module.`)."""
    while isinstance(model, DDP) or hasattr(model, "_orig_mod"):
        model = model.module if isinstance(model, DDP) else model._orig_mod  # type: ignore[assignment]
    return model


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unwrapped model's weights, detached copies on the CPU."""
    return {k: v.detach().to("cpu", copy=True) for k, v in unwrap(model).state_dict().items()}


def check_precision(precision: str, device_type: str) -> torch.dtype | None:
    """The compute dtype for --precision (None: fp32), refused where the hardware lacks it.

    bf16 on a CPU needs AVX512-BF16 or AMX: without them torch emulates bfloat16, which is
    slower than fp32 and defeats the point, so ddpkit refuses instead of falling back quietly.
    """
    if precision == "fp32":
        return None
    if precision != "bf16":
        raise DdpkitError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if device_type == "cuda":
        if not torch.cuda.is_bf16_supported():
            raise DdpkitError("--precision bf16: this GPU has no bfloat16 support (it needs compute capability 8.0+); use --precision fp32")
    elif not cpu_has_bf16():
        raise DdpkitError("--precision bf16: this CPU has no native bfloat16 (AVX512-BF16 or AMX); torch would emulate it, "
                          "slower than fp32. Use --precision fp32, or a GPU")
    return torch.bfloat16


def cpu_has_bf16() -> bool:
    cpu = torch.cpu
    return bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)() or getattr(cpu, "_is_amx_tile_supported", lambda: False)())


class DdpStrategy:
    """One process as is, or DDP: every rank holds the whole model and optimizer state.
    Rank 0 writes checkpoints as one file (checkpoint.py)."""

    name = "ddp"
    sharded = False  # checkpoints: one file by rank 0 (trainer.save_checkpoint, checkpoint.py)
    lockstep_forward = False  # must every rank call forward equally often? (no: DDP's eval skips DDP)

    def __init__(self, rt: Runtime, precision: str = "fp32", cfg: Any = None) -> None:
        self.rt = rt
        self.precision = precision
        self.dtype = check_precision(precision, rt.device.type)
        self.cfg = cfg  # DDP's knobs (tuning.py): bucket size, static graph, compression, fused optimizer, compile

    def setup(self, task: Any, lr: float | None) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The model to call (wrapped) and the optimizer over the parameters it updates."""
        from . import tuning
        from .task import make_optimizer

        model = task.model.to(self.rt.device)  # before the optimizer, so its state lands on the device
        optimizer = make_optimizer(task, model, lr)
        if self.cfg is None:
            return wrap_model(model, self.rt), optimizer
        optimizer = tuning.fuse_optimizer(optimizer, self.cfg.fused_optimizer, self.rt.device)
        compressing = self.cfg.grad_compression != "none"  # compressed buckets go through the backend
        grad_sync = "backend" if compressing else getattr(self.cfg, "grad_sync", "auto")
        wrapped = wrap_model(model, self.rt, grad_sync, **tuning.ddp_options(self.cfg, self.rt.backend))
        tuning.register_compression(wrapped, self.cfg.grad_compression)
        return tuning.maybe_compile(wrapped, self.cfg.compile), optimizer

    def autocast(self) -> ContextManager[Any]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.rt.device.type, dtype=self.dtype)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """The plain consolidated weights on rank 0 (None elsewhere). Collective for FSDP."""
        return plain_state_dict(model) if self.rt.is_main else None

    def load_full(self, model: nn.Module, optimizer: torch.optim.Optimizer, ckpt: dict[str, Any]) -> None:
        """Restore a one-file checkpoint that every rank holds in full."""
        unwrap(model).load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])

    def load_sharded(self, model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
        """Restore a sharded (FSDP, torch.distributed.checkpoint) checkpoint, any world size."""
        from .checkpoint_dcp import load_dcp

        load_dcp(path, model, optimizer)


def make_strategy(cfg: Any, rt: Runtime, task: Any) -> DdpStrategy:
    """The strategy --strategy names; `auto` asks the memory plan (DDP when it fits)."""
    name = cfg.strategy
    if name == "auto":
        name = choose_strategy(cfg, rt, task)
    if name == "fsdp":
        if rt.world_size < 2:
            raise DdpkitError(FSDP_NEEDS_TWO)
        check_no_ddp_only_flags(cfg)  # --strategy auto chose FSDP (an explicit fsdp was checked before launch)
        from .fsdp import FsdpStrategy

        return FsdpStrategy(rt, cfg.precision, blocks=getattr(task, "fsdp_blocks", None))
    return DdpStrategy(rt, cfg.precision, cfg)


def choose_strategy(cfg: Any, rt: Runtime, task: Any) -> str:
    """DDP if model, gradients and optimizer state fit each device, else FSDP (the plan's rule)."""
    from .fsdp import default_blocks
    from .plan import detect_device_memory, make_plan

    budget = cfg.device_memory
    name = "given"
    if budget is None:
        budget, name = detect_device_memory(rt.device.type, rt.env.local_world_size)
        if dist.is_initialized() and rt.world_size > 1:  # the smallest device decides, the same on every rank
            t = torch.tensor([budget], dtype=torch.int64, device=_collective_device(rt))
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            budget = int(t.item())
    plan = make_plan(task.model, task.optimizer, rt.world_size, cfg.precision, budget, name,
                     getattr(task, "fsdp_blocks", None) or default_blocks)
    choice = plan.choose()
    if not cfg.quiet:
        rt.print(f"ddpkit: --strategy auto: {plan.reason()}")
    return choice


def _collective_device(rt: Runtime) -> torch.device:
    return rt.device if rt.backend == "nccl" else torch.device("cpu")

