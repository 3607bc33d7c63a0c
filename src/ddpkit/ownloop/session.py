"""What a user who keeps their own loop gets from `ddpkit.init()`: the job's Runtime (rank,
device, process group) and the pieces of ddpkit's loop, each the one `ddpkit train` runs:
wrap, autocast, no_sync, clip_grad_norm through the same Strategy (DDP or FSDP, precision,
checked by the same rules), loader through data.rank_loader; plus save and load.

The same script runs unchanged under `ddpkit launch`, torchrun and srun, or alone.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable

import torch
from torch import nn

from ..checkpoint import whole
from ..checkpoint.world_mark import WorldMark
from ..config.processes import DEFAULT_TIMEOUT_S
from ..data import ShardedLoader, StreamLoader, rank_loader
from ..environments import DistEnv
from ..errors import DdpkitError
from ..parallel.dims import ParallelDims
from ..runtime import Collectives, Runtime
from ..runtime.group import RankView
from ..storage.location import is_url
from ..strategies import Strategy, StrategyConfig, check, strategy_for
from ..util.envvars import TIMEOUT_VAR


def _held(name: str) -> Any:
    """The Session's Runtime's attribute `name`, read through the Session."""
    return property(lambda self: getattr(self.runtime, name), doc=f"The Runtime's {name}.")


class Session(RankView):
    """The job's Runtime (`rt.runtime`: rank, device, process group) with the own-loop helpers,
    each the code `ddpkit train` runs; its rank, print and collectives are the Runtime's own
    (RankView). Use it as a context manager: the process group is torn down on every exit path."""

    def __init__(self, env: DistEnv, **runtime: Any) -> None:
        """`runtime`: the Runtime's settings (device, backend, timeout, threads, store)."""
        self.runtime = Runtime(env, **runtime)
        self.strategy: Strategy | None = None
        self._marks: dict[Path, WorldMark] = {}  # the folders this world saved into: it owns them until another does
        self.scaler: Any = None  # fp16's torch.amp.GradScaler after rt.wrap(..., precision="fp16"); None otherwise

    def wrap(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        strategy: str = "ddp",
        precision: str = "fp32",
        grad_sync: str = "auto",
        blocks: Callable[[nn.Module], Iterable[nn.Module]] | None = None,
        activation_checkpointing: bool = False,
        checkpoint_blocks: Callable[[nn.Module], Iterable[nn.Module]] | None = None,
        **ddp_options: Any,
    ) -> Any:
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
        activation_checkpointing=True: each block keeps only its input through the forward and
        recomputes the rest in backward (`checkpoint_blocks(model)`, default: the FSDP blocks
        above), under either strategy; parameter names and saved keys stay the same.
        """
        config = StrategyConfig(
            name=strategy,
            precision=precision,
            grad_sync=grad_sync,
            activation_checkpointing=activation_checkpointing,
            ddp_options=ddp_options,
            fused_optimizer="off",  # an own loop's optimizer is the one it passed, as it made it
        )
        check(config, self.world_size, own_loop=True)
        if self.strategy is not None and (self.strategy.name, self.strategy.precision) != (strategy, precision):
            raise DdpkitError(
                f"this session already wraps with strategy={self.strategy.name!r}, precision="
                f"{self.strategy.precision!r}: rt.autocast() and rt.scaler serve one; wrap every model alike"
            )
        chosen = strategy_for(config, self.runtime, blocks=blocks, checkpoint_blocks=checkpoint_blocks)
        wrapped = chosen.setup_module(model)
        if optimizer is not None:
            optimizer = chosen.setup_optimizer(optimizer, wrapped)
            whole.check_optimizer_of(wrapped, optimizer)
        self.strategy = chosen
        self.scaler = chosen.grad_scaler()
        return wrapped if optimizer is None else (wrapped, optimizer)

    def loader(
        self, dataset: Any, batch_size: int, shuffle: bool = True, seed: int = 0, **kwargs: Any
    ) -> ShardedLoader | StreamLoader:
        """This rank's batches of `dataset` (batch_size per process), in ddpkit's global
        order: call .set_epoch(epoch) on it before each epoch. A stream (an IterableDataset,
        ddpkit.ShardedStream) is dealt out by shard or round-robin, and every rank's pass ends
        at the same step (data/streams.py); its .state() goes in your checkpoint, .load(states)
        (every rank's, e.g. from rt.all_gather_object) resumes it."""
        return rank_loader(dataset, batch_size, self.runtime, seed=seed, shuffle=shuffle, **kwargs)

    # -- a training step -------------------------------------------------------------
    def autocast(self) -> ContextManager[Any]:
        """The forward's precision, as rt.wrap(precision=...) chose (nothing for fp32 and under
        FSDP, whose units cast themselves)."""
        return self.strategy.autocast() if self.strategy is not None else contextlib.nullcontext()

    def no_sync(self, model: nn.Module, skip: bool = True) -> ContextManager[Any]:
        """Gradient accumulation: while active (and `skip`), backward accumulates gradients
        locally, without communication; run the step's last micro-batch outside it (or with
        skip=False) to sync them all at once. DDP's no_sync, FSDP2's requires_gradient_sync."""
        return (self.strategy or _plain_strategy(self.runtime, model)).no_sync(model, skip)

    def accumulate(self, model: nn.Module, micro_step: int, every: int) -> ContextManager[Any]:
        """`with rt.accumulate(model, i, K):` around micro-batch i's forward and backward:
        gradients sync only on every K-th micro-batch (i % K == K - 1)."""
        return self.no_sync(model, skip=micro_step % every != every - 1)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        """Clip the global gradient 2-norm (over every rank and shard) to `max_norm`; returns
        the norm before clipping, the same on every rank. Call it after the sync (backward
        outside no_sync), before optimizer.step()."""
        return (self.strategy or _plain_strategy(self.runtime, model)).clip_grad_norm(model, max_norm)

    # -- checkpoints -----------------------------------------------------------------
    def save(self, path: str, model: nn.Module, optimizer: Any = None, *, sharded: bool = False, **extra: Any) -> None:
        """Save model (unwrapped), optimizer and plain `extra`; call it on every rank.

        sharded=False: one file written by rank 0 atomically, plain tensors whatever wraps the
        model: the state of an FSDP (or any DTensor) model is gathered to rank 0 first.
        `torch.load(path, weights_only=True)["model"]` loads into a plain model.
        sharded=True: a folder of every rank's shards (torch.distributed.checkpoint), renamed
        into place once complete; loads at any world size. Refused with a clear error: weights
        on the meta device, an optimizer over other parameters, NaN/inf weights, and a folder
        another world saved into since this one first did (two jobs, or a split elastic job:
        the newest owns it, as `ddpkit train`'s run directory, checkpoint/world_mark.py).
        A bucket URL (s3://BUCKET/PREFIX/NAME, ddpkit[s3]): written locally, then committed with
        a manifest last (ownloop/bucket.py); a sharded one on one node only."""
        whole.check_savable(model)  # refusals first: a refused save marks no folder
        if optimizer is not None:
            whole.check_optimizer_of(model, optimizer)
        if is_url(path):  # s3://BUCKET/PREFIX/NAME: staged, then committed by a manifest written last
            from .bucket import save_to_url

            save_to_url(self, str(path), model, optimizer, sharded, extra)
            return
        self._check_owner(path)
        if sharded:
            from ..checkpoint.sharded import save_state_dir

            save_state_dir(path, model, optimizer, extra, self.runtime)
            return
        try:
            whole.save_whole(path, model, optimizer, extra, self.is_main)
        finally:
            self.barrier()  # no rank reads the file before it is there (nor hangs if rank 0 refused)

    def _check_owner(self, path: str) -> None:
        """Collective: the folder of `path` is this world's. The first save into a folder marks
        it (rank 0); each later one finds out, in one small all-reduce, whether another world
        has marked it since, and then every rank refuses."""
        folder = Path(path).absolute().parent
        mark = self._marks.get(folder)
        if mark is None:
            mark = self._marks[folder] = WorldMark(folder, self.is_main, self.world_size, self.env.nnodes)
            if self.is_main:
                folder.mkdir(parents=True, exist_ok=True)
                mark.claim()
            return
        if mark.lost_anywhere(self.collectives, self.device):
            raise mark.error(f"rt.save({path!r})", own_loop=True)

    def load(self, path: str, model: nn.Module, optimizer: Any = None) -> dict[str, Any]:
        """Load what save() wrote (either kind) into model/optimizer on every rank, whatever
        wraps them now (a whole file into an FSDP model, shards into a DDP one); returns the extras.
        A bucket URL: the committed save of that name, downloaded and checked against its manifest."""
        if is_url(path):
            from .bucket import load_from_url

            return load_from_url(self, str(path), model, optimizer)
        if whole.saved_kind(path) == "sharded":
            from ..checkpoint.sharded import load_state_dir

            return load_state_dir(path, model, optimizer)
        return whole.load_whole(path, model, optimizer)

    # -- what the Runtime holds (RankView reads them) ---------------------------------
    env: DistEnv = _held("env")
    device: torch.device = _held("device")
    backend: str = _held("backend")
    timeout: float = _held("timeout")
    collectives: Collectives = _held("collectives")
    dims: ParallelDims = _held("dims")  # the job's mesh: every rank data-parallel in an own loop

    def close(self) -> None:
        """Tear the process group down (let go of wrapped models and optimizers first)."""
        self.strategy = None
        self.runtime.close()


def _plain_strategy(rt: Runtime, model: nn.Module) -> Strategy:
    """For a model the user wrapped without rt.wrap (DDP, or torch's own fully_shard)."""
    return strategy_for(StrategyConfig(name="fsdp" if hasattr(model, "set_requires_gradient_sync") else "ddp"), rt)


def init(
    device: str = "auto", backend: str = "auto", timeout: float | None = None, threads: int | None = None
) -> Session:
    """For scripts with their own loop: join the job this process was started in (by
    `ddpkit launch`, torchrun or srun; alone otherwise) and return its Session (session.py).
    Use it as a context manager so the process group is always torn down. `timeout`: seconds a
    collective may wait (default: `ddpkit launch --timeout`, else DEFAULT_TIMEOUT_S)."""
    if timeout is None:
        timeout = float(os.environ.get(TIMEOUT_VAR) or DEFAULT_TIMEOUT_S)
    return Session(DistEnv.detect_worker(), device=device, backend=backend, timeout=timeout, threads=threads)
