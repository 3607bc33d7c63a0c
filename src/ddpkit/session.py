"""What a user who keeps their own loop gets from `ddpkit.init()`: the Runtime (rank, device,
process group) plus the pieces of ddpkit's loop: wrap (DDP or FSDP, precision), loader,
autocast, no_sync, clip_grad_norm, save, load.

The same script runs unchanged under `ddpkit launch`, torchrun and srun, or alone.
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any, Callable, ContextManager, Iterable

import torch
from torch import nn

from .checkpoint import whole
from .config import FSDP_NEEDS_TWO, STRATEGIES
from .data import ShardedLoader
from .errors import DdpkitError
from .runtime import Runtime
from .strategies import DdpStrategy, Strategy, wrap_model


class Session(Runtime):
    """A Runtime with the own-loop helpers. Use it as a context manager: the process group
    is torn down on every exit path."""

    strategy: Strategy | None = None
    scaler: Any = None  # fp16's torch.amp.GradScaler after rt.wrap(..., precision="fp16"); None otherwise

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, strategy: str = "ddp",
             precision: str = "fp32", grad_sync: str = "auto",
             blocks: Callable[[nn.Module], Iterable[nn.Module]] | None = None, **ddp_options: Any) -> Any:
        """The model on this rank's device, parallelised, and (given `optimizer`) the
        optimizer it needs: `model = rt.wrap(model)` or `model, opt = rt.wrap(model, opt)`.

        strategy='ddp': DDP when there are several ranks (DDP's keyword arguments pass
        through; grad_sync='auto' sums CPU gradients of one machine's ranks in shared memory,
        'backend' keeps gloo/NCCL; a comm hook you register on the result takes over).
        strategy='fsdp': FSDP2 `fully_shard` per block (`blocks(model)`, default: the
        outermost ModuleList's elements, else a Sequential's children), then the root; every
        rank starts from rank 0's weights; an optimizer built over the unsharded model is
        rebuilt over the shards (same class and settings), so pass it here.
        precision='bf16' (autocast under DDP, bf16 compute with fp32 weights under FSDP) or
        'fp16' (DDP on a GPU, with `rt.scaler`); use `with rt.autocast():` around the forward.
        """
        if strategy not in STRATEGIES[:2]:
            raise DdpkitError(f"rt.wrap(strategy=...) must be 'ddp' or 'fsdp', got {strategy!r}")
        if self.strategy is not None and (self.strategy.name, self.strategy.precision) != (strategy, precision):
            raise DdpkitError(f"this session already wraps with strategy={self.strategy.name!r}, precision="
                              f"{self.strategy.precision!r}: rt.autocast() and rt.scaler serve one; wrap every model alike")
        task = SimpleNamespace(model=model, optimizer=optimizer, fsdp_blocks=blocks)
        if strategy == "fsdp":
            if ddp_options or grad_sync != "auto":
                raise DdpkitError(f"rt.wrap(strategy='fsdp'): {', '.join([*ddp_options, *(['grad_sync'] if grad_sync != 'auto' else [])])} "
                                  "are DDP options; drop them or use strategy='ddp'")
            if precision == "fp16":
                raise DdpkitError("precision='fp16' needs a gradient scaler, which ddpkit offers under DDP only; use 'bf16' with FSDP")
            if self.world_size < 2:
                raise DdpkitError(FSDP_NEEDS_TWO.replace("--nproc 2 or more", "start the script with 2 or more processes")
                                  .replace("--strategy ddp", "strategy='ddp'"))
            from .strategies.fsdp import FsdpStrategy  # FSDP's imports cost ~0.5 s

            fsdp = FsdpStrategy(self, precision, blocks=blocks)
            if optimizer is None:  # no optimizer yet: build it afterwards over model.parameters()
                task.optimizer = lambda params: torch.optim.SGD(params, lr=0.0)
                wrapped, _ = fsdp.setup(task, None)
            else:
                wrapped, optimizer = fsdp.setup(task, None)
            self.strategy = fsdp
        else:
            self.strategy = DdpStrategy(self, precision)
            wrapped = wrap_model(model, self, grad_sync, **ddp_options)
            if optimizer is not None:
                whole.check_optimizer_of(wrapped, optimizer)
        self.scaler = self.strategy.grad_scaler()
        return wrapped if optimizer is None else (wrapped, optimizer)

    def loader(self, dataset: Any, batch_size: int, shuffle: bool = True, seed: int = 0, **kwargs: Any) -> ShardedLoader:
        """This rank's batches of `dataset` (batch_size per process), in ddpkit's global
        order: call .set_epoch(epoch) on it before each epoch."""
        return ShardedLoader(dataset, batch_size, self.rank, self.world_size, seed=seed, shuffle=shuffle, **kwargs)

    # -- a training step -------------------------------------------------------------
    def autocast(self) -> ContextManager[Any]:
        """The forward's precision, as rt.wrap(precision=...) chose (nothing for fp32 and under
        FSDP, whose units cast themselves)."""
        return self.strategy.autocast() if self.strategy is not None else contextlib.nullcontext()

    def no_sync(self, model: nn.Module, skip: bool = True) -> ContextManager[Any]:
        """Gradient accumulation: while active (and `skip`), backward accumulates gradients
        locally, without communication; run the step's last micro-batch outside it (or with
        skip=False) to sync them all at once. DDP's no_sync, FSDP2's requires_gradient_sync."""
        return (self.strategy or _plain_strategy(self, model)).no_sync(model, skip)

    def accumulate(self, model: nn.Module, micro_step: int, every: int) -> ContextManager[Any]:
        """`with rt.accumulate(model, i, K):` around micro-batch i's forward and backward:
        gradients sync only on every K-th micro-batch (i % K == K - 1)."""
        return self.no_sync(model, skip=micro_step % every != every - 1)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        """Clip the global gradient 2-norm (over every rank and shard) to `max_norm`; returns
        the norm before clipping, the same on every rank. Call it after the sync (backward
        outside no_sync), before optimizer.step()."""
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    # -- checkpoints -----------------------------------------------------------------
    def save(self, path: str, model: nn.Module, optimizer: Any = None, *, sharded: bool = False, **extra: Any) -> None:
        """Save model (unwrapped), optimizer and plain `extra`; call it on every rank.

        sharded=False: one file written by rank 0 atomically, plain tensors whatever wraps the
        model: the state of an FSDP (or any DTensor) model is gathered to rank 0 first.
        `torch.load(path, weights_only=True)["model"]` loads into a plain model.
        sharded=True: a folder of every rank's shards (torch.distributed.checkpoint), renamed
        into place once complete; loads at any world size. Refused with a clear error: weights
        on the meta device, an optimizer over other parameters, NaN/inf weights."""
        if sharded:
            from .checkpoint.sharded import save_state_dir

            whole.check_savable(model)
            if optimizer is not None:
                whole.check_optimizer_of(model, optimizer)
            save_state_dir(path, model, optimizer, extra, self)
            return
        try:
            whole.save_whole(path, model, optimizer, extra, self.is_main)
        finally:
            self.barrier()  # no rank reads the file before it is there (nor hangs if rank 0 refused)

    def load(self, path: str, model: nn.Module, optimizer: Any = None) -> dict[str, Any]:
        """Load what save() wrote (either kind) into model/optimizer on every rank, whatever
        wraps them now (a whole file into an FSDP model, shards into a DDP one); returns the extras."""
        if whole.saved_kind(path) == "sharded":
            from .checkpoint.sharded import load_state_dir

            return load_state_dir(path, model, optimizer)
        return whole.load_whole(path, model, optimizer)

    def __enter__(self) -> Session:
        return self


def _plain_strategy(rt: Runtime, model: nn.Module) -> Strategy:
    """For a model the user wrapped without rt.wrap (DDP, or torch's own fully_shard)."""
    if hasattr(model, "set_requires_gradient_sync"):
        from .strategies.fsdp import FsdpStrategy

        return FsdpStrategy(rt)
    return DdpStrategy(rt)
