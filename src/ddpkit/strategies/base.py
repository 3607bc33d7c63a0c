"""The Strategy: everything that depends on how the model is parallelised, behind one face.

The training loop calls these and never asks which strategy it has:
  setup_module     the model on this rank's device, wrapped (DDP) or sharded (FSDP, over a mesh)
  setup_optimizer  the task's optimizer (an instance or a factory) over what the wrapped model steps
  autocast         the forward's precision
  no_sync          skip the gradient sync on a micro-batch that is not the step's last
  clip_grad_norm   the global gradient norm (over every shard), clipped
  eval_batches     this rank's evaluation batches, each sample counted once
  eval_module      what evaluation calls
  save_checkpoint  every rank's RNG states, then the strategy's kind of checkpoint
  load_checkpoint  either kind of checkpoint into this run's model and optimizer
  full_state_dict  the plain weights (model.pt), gathered when sharded
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, ContextManager, Iterator

import torch
from torch import nn

from ..checkpoint import file as ckpt_file
from ..checkpoint import state as ckpt_state
from ..checkpoint.retention import prune, record_metric
from ..data import eval_batches
from ..runtime import Runtime
from ..strategy_config import StrategyConfig
from .optimizers import OptimizerSpec
from .precision import autocast, check_precision


class Strategy:
    """Base of DdpStrategy (ddp.py) and FsdpStrategy (fsdp.py).

    `config`: the typed settings (strategy_config.py), already checked; `checkpoints`: the
    run's settings that the checkpoint methods below read (--keep-last/--keep-best/
    --best-metric, --async-save), None where nothing is retained."""

    name = "base"
    eval_lockstep = False  # must every rank call forward as often as the others in evaluation?

    def __init__(self, rt: Runtime, config: StrategyConfig | None = None, *, checkpoints: Any = None) -> None:
        self.rt = rt
        self.config = config or StrategyConfig(name=self.name)
        self.precision = self.config.precision
        self.dtype = check_precision(self.precision, rt.device.type)
        self.cfg = checkpoints
        self.writer = ckpt_file.BackgroundWriter() if getattr(checkpoints, "async_save", False) else None

    # -- building -------------------------------------------------------------------
    def setup_module(self, model: nn.Module) -> nn.Module:
        """The model to call: on this rank's device, wrapped or sharded, every rank starting
        from rank 0's weights. Call it before setup_optimizer."""
        raise NotImplementedError

    def setup_optimizer(self, spec: OptimizerSpec, model: nn.Module, lr: float | None = None) -> torch.optim.Optimizer:
        """The optimizer over the parameters `model` (what setup_module returned) steps: the
        task's instance or factory, with --lr applied when given."""
        raise NotImplementedError

    # -- a training step ------------------------------------------------------------
    def autocast(self) -> ContextManager[Any]:
        return autocast(self.rt.device.type, self.dtype)

    def grad_scaler(self) -> Any:
        """fp16's loss scaler (its gradients would underflow without one); None otherwise."""
        if self.dtype is not torch.float16:
            return None
        return torch.amp.GradScaler(self.rt.device.type)

    def no_sync(self, model: nn.Module, skip_sync: bool) -> ContextManager[Any]:
        """While active, backward accumulates gradients locally (no communication); the
        step's last micro-batch runs outside it and syncs them all at once."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        """Clip the gradients to a total 2-norm of `max_norm`; returns the norm before
        clipping, the same on every rank: after the sync every replica holds the same
        gradients, and sharded gradients (DTensors) make the norm a collective over the shards."""
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def check_output(self, output: Any) -> None:
        """Called on the first training forward: refuse an output this strategy cannot work with."""

    def grad_sync(self, model: nn.Module) -> str:
        """How gradients travel, for the summary."""
        return self.name

    # -- evaluation -----------------------------------------------------------------
    def eval_module(self, model: nn.Module) -> nn.Module:
        return model

    def eval_batches(self, dataset: Any, batch_size: int, num_workers: int = 0) -> Iterator[Any]:
        """Contiguous unpadded slices: every sample counted once; with `eval_lockstep`,
        empty batches pad the ranks that have fewer, so every rank runs as many forwards."""
        return eval_batches(dataset, batch_size, self.rt.rank, self.rt.world_size, num_workers, lockstep=self.eval_lockstep)

    # -- checkpoints ----------------------------------------------------------------
    def save_checkpoint(self, run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                        pos: ckpt_state.Position, config: dict[str, Any], extra: dict[str, Any] | None = None,
                        metric: float | None = None) -> None:
        """Collective: every rank contributes its RNG state; the strategy writes its kind.
        `extra`: plain state to keep beside them (the LR scheduler's, the gradient scaler's);
        `metric`: the --best-metric value at this checkpoint, for --keep-best."""
        rng_states = self.rt.all_gather_object(ckpt_state.rng_state())
        self._metric = (ckpt_file.checkpoint_path(run_dir, pos.epoch, pos.step).stem, metric) if metric is not None else None
        self._write_checkpoint(run_dir, model, optimizer, pos, rng_states, config, extra or {})
        if self.writer is None:
            self.prune(run_dir, self._metric)  # (a background write prunes once its file is complete)

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Leave only once the last background checkpoint is written; on an error, wait for it
        too (its own error, if any, is not the one to report then)."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                self.wait_for_saves()
            raise
        self.wait_for_saves()

    def wait_for_saves(self) -> None:
        """--async-save: block until the last checkpoint is on disk (raises its error, if any)."""
        if self.writer is not None:
            self.writer.wait()

    def prune(self, run_dir: Path, metric: tuple[str, float] | None = None) -> None:
        """--keep-last/--keep-best: rank 0 records the new checkpoint's metric, then deletes what
        a complete newer checkpoint makes old."""
        keep, best = getattr(self.cfg, "keep_last", None), getattr(self.cfg, "keep_best", None)
        if best and self.rt.is_main and metric is not None:
            record_metric(run_dir, *metric)
        if (keep or best) and self.rt.is_main:
            prune(run_dir, keep, best, maximize=str(getattr(self.cfg, "best_metric", "")).endswith(":max"))

    def _write_checkpoint(self, run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, pos: ckpt_state.Position,
                          rng_states: list[dict[str, Any]], config: dict[str, Any], extra: dict[str, Any]) -> None:
        raise NotImplementedError

    def load_checkpoint(self, kind: str, ckpt: dict[str, Any], path: Path, model: nn.Module,
                        optimizer: torch.optim.Optimizer) -> None:
        """Restore a checkpoint of either kind: 'file' (held whole by every rank) or
        'sharded' (a torch.distributed.checkpoint folder, read at any world size)."""
        from ..checkpoint.sharded import load_dcp  # torch.distributed.checkpoint: ~0.5 s to import, only when needed

        if kind == "file":
            self._load_full(model, optimizer, ckpt)
        else:
            load_dcp(path, model, optimizer)

    def _load_full(self, model: nn.Module, optimizer: torch.optim.Optimizer, ckpt: dict[str, Any]) -> None:
        ckpt_state.unwrap(model).load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """The plain consolidated weights on rank 0 (None elsewhere). Collective when sharded."""
        return ckpt_state.plain_state_dict(model) if self.rt.is_main else None
