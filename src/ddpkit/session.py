"""What a user who keeps their own loop gets from `ddpkit.init()`: the Runtime (rank, device,
process group) plus the pieces of ddpkit's loop: wrap, loader, save, load.

The same script runs unchanged under `ddpkit launch`, torchrun and srun, or alone.
"""
from __future__ import annotations

from typing import Any

import torch

from .checkpoint import load_state, save_state
from .data import ShardedLoader
from .runtime import Runtime
from .strategies import wrap_model


class Session(Runtime):
    """A Runtime with the own-loop helpers. Use it as a context manager: the process group
    is torn down on every exit path."""

    def wrap(self, model: torch.nn.Module, grad_sync: str = "auto", **ddp_options: Any) -> torch.nn.Module:
        """The model on this rank's device, in DDP when there are several ranks (DDP's
        keyword arguments pass through). grad_sync='auto' all-reduces CPU gradients of
        ranks on one machine through shared memory ('backend': gloo/NCCL); a
        communication hook you register on the returned model takes over."""
        return wrap_model(model, self, grad_sync, **ddp_options)

    def loader(self, dataset: Any, batch_size: int, shuffle: bool = True, seed: int = 0, **kwargs: Any) -> ShardedLoader:
        """This rank's batches of `dataset` (batch_size per process), in ddpkit's global
        order: call .set_epoch(epoch) on it before each epoch."""
        return ShardedLoader(dataset, batch_size, self.rank, self.world_size, seed=seed, shuffle=shuffle, **kwargs)

    def save(self, path: str, model: torch.nn.Module, optimizer: Any = None, **extra: Any) -> None:
        """Rank 0 writes model (unwrapped), optimizer and `extra` atomically; all ranks wait."""
        if self.is_main:
            save_state(path, model, optimizer, **extra)
        self.barrier()

    def load(self, path: str, model: torch.nn.Module, optimizer: Any = None) -> dict[str, Any]:
        """Load what save() wrote into model/optimizer on every rank; returns the extras."""
        return load_state(path, model, optimizer)

    def __enter__(self) -> Session:
        return self
