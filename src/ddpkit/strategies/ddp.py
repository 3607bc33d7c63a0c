"""DDP: every rank holds the whole model and optimizer state; gradients are averaged once
per optimizer step (in shared memory for CPU ranks of one machine, else by the backend).
Rank 0 writes checkpoints as one file (checkpoint/file.py)."""

from __future__ import annotations

from typing import Any, ContextManager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..checkpoint.state import unwrap
from ..runtime import Runtime
from . import ddp_knobs
from .base import Strategy
from .compiling import compiled_record
from .grad_sync import carry_agreement, install
from .materialize import fill
from .optimizers import OptimizerSpec, make_optimizer


def wrap_model(model: nn.Module, rt: Runtime, grad_sync: str = "auto", **ddp_options: Any) -> nn.Module:
    """Move the model to this rank's device and wrap it in DDP when there are several ranks.
    DDP broadcasts rank 0's parameters, so every replica starts identical.

    grad_sync: 'auto' all-reduces gradients through shared memory when every rank is on
    this machine's CPUs (runtime/shm.py; bit-identical to gloo with 2 ranks), else with
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
    mapping = install(
        ddp, grad_sync, rt.env.local_world_size, rt.backend, rt.device.type, say=rt.print, timeout=rt.timeout
    )
    if mapping is not None:
        rt.collectives.use_shared_memory(mapping)  # the loop's small all-reduces take the same path
    ddp._ddpkit_grad_sync = "shm" if mapping is not None else rt.backend  # type: ignore[assignment]  (for summaries)
    ddp._ddpkit_agreement = carry_agreement(ddp, mapping, rt.backend)  # type: ignore[assignment]  (training/step.py)
    return ddp


def agreement_of(model: nn.Module) -> Any:
    """The Agreement this model's gradient sync carries (strategies/agreement.py), or None."""
    return getattr(getattr(model, "_orig_mod", model), "_ddpkit_agreement", None)


def grad_sync_used(model: nn.Module) -> str:
    """How this model's gradients are all-reduced: 'shm', the backend's name, or 'none'
    (one process, or a model ddpkit did not wrap in DDP)."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "_ddpkit_grad_sync", "none")


class DdpStrategy(Strategy):
    """One process as is, or DDP, with DDP's knobs (ddp_knobs.py)."""

    name = "ddp"

    def setup_module(self, model: nn.Module) -> nn.Module:
        config = self.config
        self.checkpoint_activations(model)
        compressing = config.grad_compression != "none"  # compressed buckets go through the backend
        grad_sync = "backend" if compressing else config.grad_sync
        options = {**ddp_knobs.ddp_options(config, self.rt.backend), **config.ddp_options}
        model = fill(model, self.rt.device, self.model_init(model))  # a meta build, whole; pretrained weights
        wrapped = wrap_model(model, self.rt, grad_sync, **options)  # (DDP keeps the same parameters)
        ddp_knobs.register_compression(wrapped, config.grad_compression)
        if self.compile_choice is None:
            return wrapped
        if self.checkpointed:  # the whole DDP graph would not recompute the blocks: each block's forward
            self.compile_blocks(model, self.checkpointed)
            return wrapped
        self.compiled = compiled_record(self.compile_choice, "model")
        return ddp_knobs.maybe_compile(wrapped, self.compile_choice.backend)

    def setup_optimizer(self, spec: OptimizerSpec, model: nn.Module, lr: float | None = None) -> torch.optim.Optimizer:
        optimizer = make_optimizer(spec, model, lr)  # after the move to the device: its state lands there
        return ddp_knobs.fuse_optimizer(optimizer, self.config.fused_optimizer, self.rt.device)

    def no_sync(self, model: nn.Module, skip_sync: bool) -> ContextManager[Any]:
        inner = getattr(model, "_orig_mod", model)
        if skip_sync and isinstance(inner, DDP):
            return inner.no_sync()
        return super().no_sync(model, skip_sync)

    def grad_sync(self, model: nn.Module) -> str:
        return grad_sync_used(model)

    def agreement(self, model: nn.Module) -> Any:
        return agreement_of(model)

    def eval_module(self, model: nn.Module) -> nn.Module:
        return unwrap(model)  # no DDP forward: ranks may run different numbers of eval batches
