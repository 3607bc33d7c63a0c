"""The Strategy: everything that depends on how the model is parallelised, behind one face.

The training loop calls these and never asks which strategy it has:
  setup_module     the model on this rank's device, wrapped (DDP) or sharded (FSDP, over a mesh)
  setup_optimizer  the task's optimizer (an instance or a factory) over what the wrapped model steps
  autocast         the forward's precision
  no_sync          skip the gradient sync on a micro-batch that is not the step's last
  clip_grad_norm   the global gradient norm (over every shard), clipped
  eval_batches     this rank's evaluation batches, each sample counted once
  eval_module      what evaluation calls
  checkpoint_kind  which kind the checkpointer writes: one file (rank 0) or shards (every rank)
  load_full        a one-file checkpoint into this run's model (whole, or this rank's shards)
  full_state_dict  the plain weights (model.pt), gathered when sharded
  checkpoint_activations  --activation-checkpointing on the blocks, before the wrapping (activation.py)
  compile_blocks   --compile: each block's forward compiled, the root eager (compiling.py)
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, ContextManager, Iterator

import torch
from torch import nn

from ..checkpoint import file as ckpt_file
from ..checkpoint import state as ckpt_state
from ..data import eval_batches
from ..parallel.spec import StrategyConfig
from ..runtime import Runtime
from .activation import BlocksHook, checkpoint_blocks
from .compiling import CompileChoice, choose_backend, compile_forwards, compiled_record
from .materialize import ModelInit, on_meta
from .optimizers import OptimizerSpec
from .precision import autocast, check_precision


class Strategy:
    """Base of DdpStrategy (ddp.py) and FsdpStrategy (fsdp.py).

    `config`: the typed settings (strategy_config.py), already checked. `checkpoint_blocks`:
    the blocks --activation-checkpointing recomputes (None: FSDP's default_blocks)."""

    name = "base"
    eval_lockstep = False  # must every rank call forward as often as the others in evaluation?
    checkpoint_kind = "file"  # "file": rank 0 writes one file; "sharded": every rank writes its shards
    tp_plan: dict[str, str] | None = None  # the task's tensor-parallel plan (tensor_parallel.py), under --tp

    def __init__(
        self, rt: Runtime, config: StrategyConfig | None = None, *, checkpoint_blocks: BlocksHook | None = None
    ) -> None:
        self.rt = rt
        self.config = config or StrategyConfig(name=self.name)
        self.precision = self.config.precision
        self.dtype = check_precision(self.precision, rt.device.type)
        # a meta-built model's init and a pretrained file to start from (make_strategy sets the task's)
        self.init = ModelInit()
        self.checkpoint_blocks = checkpoint_blocks
        self.checkpointed: list[nn.Module] = []  # the blocks activation checkpointing recomputes
        # --compile: the backend (inductor, or aot_eager where inductor cannot build kernels) and
        # what setup_module compiled (summary.json's "compile"; None without --compile)
        self.compile_choice: CompileChoice | None = choose_backend(rt.device.type) if self.config.compile else None
        self.compiled: dict[str, Any] | None = None

    # -- building -------------------------------------------------------------------
    def setup_module(self, model: nn.Module) -> nn.Module:
        """The model to call: on this rank's device, wrapped or sharded, every rank starting
        from rank 0's weights. Call it before setup_optimizer."""
        raise NotImplementedError

    def model_init(self, model: nn.Module) -> ModelInit:
        """How setup_module fills `model`: the run's ModelInit; a meta model without a seed (an
        own loop's) draws from rank 0's next random number on every rank, so the ranks'
        parts are of the same weights."""
        init = self.init
        if init.seed is not None or self.rt.world_size < 2 or not on_meta(model):
            return init
        seed = torch.randint(0, 2**62, (1,)) if self.rt.is_main else torch.zeros(1, dtype=torch.int64)
        shared = self.rt.collectives.all_sum(seed.to(self.rt.collective_device))
        return dataclasses.replace(init, seed=int(shared.item()))

    def checkpoint_activations(self, model: nn.Module) -> None:
        """With activation checkpointing on, hook each block of the still unwrapped model:
        first, as torch orders it (checkpointing, compile, then DDP or sharding)."""
        if self.config.activation_checkpointing:
            self.checkpointed = checkpoint_blocks(model, self.checkpoint_blocks)

    def compile_blocks(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        """With --compile, torch.compile each block's forward (after checkpointing hooked it,
        around FSDP's hooks), the root eager; a model without blocks has its own forward
        compiled. Its hooks stay eager either way (compiling.py says why)."""
        if self.compile_choice is None:
            return
        backend = self.compile_choice.backend
        if blocks:
            self.compiled = compiled_record(self.compile_choice, "blocks", compile_forwards(blocks, backend))
        else:
            compile_forwards([model], backend)
            self.compiled = compiled_record(self.compile_choice, "root")

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

    def agreement(self, model: nn.Module) -> Any:
        """The step's flags ride with this model's gradient sync when this returns an Agreement
        (strategies/agreement.py); None: the runner all-reduces them after the backward."""
        return None

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        """Clip the gradients to a total 2-norm of `max_norm`; returns the norm before
        clipping, the same on every rank: after the sync every replica holds the same
        gradients, and sharded gradients (DTensors) make the norm a collective over the shards."""
        return float(self.clip_grad_norm_(model, max_norm))

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """clip_grad_norm, the norm left on the device (no host synchronisation: training/step.py)."""
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

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
        dims = self.rt.dims  # the data-parallel rank and world: a tp group evaluates one slice together
        return eval_batches(dataset, batch_size, dims.dp_rank, dims.dp, num_workers, lockstep=self.eval_lockstep)

    # -- checkpoints (the checkpointer, checkpoint/checkpointer.py, owns them) ---------
    def load_full(self, model: nn.Module, optimizer: torch.optim.Optimizer, ckpt: dict[str, Any]) -> None:
        """A one-file checkpoint (whole tensors) into this run's model and optimizer."""
        ckpt_state.unwrap(model).load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])

    def save_full_model(self, model: nn.Module, path: Path) -> None:
        """model.pt: the plain weights, written by rank 0 at once (no copy of what it holds).
        Collective when sharded (FSDP writes them tensor by tensor: checkpoint/streamed.py)."""
        state = self.full_state_dict(model)
        if state is not None:
            ckpt_file.save_or_explain(state, path)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """The plain consolidated weights on rank 0 (None elsewhere), to be saved at once (the
        model's own tensors where they are on the CPU). Collective when sharded."""
        if not self.rt.is_main:
            return None
        return ckpt_state.weights_to_save_now(ckpt_state.unwrap(model).state_dict())
