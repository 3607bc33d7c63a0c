"""--resume / --auto-resume: rank 0 finds the newest checkpoint that is complete and fits,
every rank loads it through the strategy (a one-file checkpoint is sent whole, so no shared
disk is needed; a sharded one is read by every rank from the run directory)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import file as ckpt_file
from ..checkpoint.state import Position, set_rng_state
from ..errors import DdpkitError
from ..runtime import Runtime
from ..strategies import Strategy


def resume(run_dir: Path, rt: Runtime, strategy: Strategy, model: nn.Module, optimizer: torch.optim.Optimizer,
           required: bool, data_size: int | None, global_batch: int, quiet: bool = False) -> tuple[Position, dict[str, Any]]:
    """Where to continue from, and the checkpoint's extra state (scheduler, scaler). `required`
    (--resume): no checkpoint is an error; otherwise (--auto-resume) no checkpoint at all
    means a fresh start. `data_size` (None for a stream) and `global_batch` are this run's:
    an older checkpoint's place in steps is turned into samples only where it is exact."""
    from ..checkpoint.sharded import find_any_resumable, list_sharded  # torch.distributed.checkpoint: ~0.5 s

    message: Any = None
    if rt.is_main:
        try:
            if not required and not ckpt_file.list_checkpoints(run_dir) and not list_sharded(run_dir):
                message = ("fresh", None, None)
            else:
                kind, ckpt, path, skipped = find_any_resumable(run_dir, model, optimizer)
                for reason in skipped:
                    print(f"ddpkit: skipping checkpoint: {reason}", flush=True)
                message = (kind, ckpt, str(path))
        except DdpkitError as e:
            message = ("error", str(e), None)
    status, payload, path = rt.broadcast_object(message)
    if status == "error":
        raise DdpkitError(payload)
    if status == "fresh":
        return Position(), {}
    pos = position_of(payload, path, data_size, global_batch)  # before loading: a refusal changes nothing
    strategy.load_checkpoint(status, payload, Path(path), model, optimizer)
    rngs = payload["rng"]
    set_rng_state(rngs[rt.rank] if len(rngs) == rt.world_size else rngs[0])
    if not quiet:
        where = f"epoch {pos.epoch} done" + (f", {pos.samples} samples into epoch {pos.epoch + 1}" if pos.mid_epoch else "")
        rt.print(f"ddpkit: resuming from {path} ({where})")
    return pos, payload.get("extra", {})


def position_of(payload: dict[str, Any], path: str, data_size: int | None, global_batch: int) -> Position:
    """The checkpoint's place in samples of the epoch's global order. A checkpoint written
    before places were kept in samples holds `step` steps of the global batch it was written
    with: exact in samples at that global batch only, so any other is refused, never guessed."""
    epoch, loss, count = int(payload["epoch"]), float(payload.get("loss_sum", 0.0)), float(payload.get("count_sum", 0.0))
    if "samples" in payload:
        return Position(epoch, int(payload["samples"]), loss, count, int(payload.get("global_step", 0)),
                        int(payload.get("global_batch", 0)))
    step = int(payload.get("step", 0))
    cfg = payload.get("config") or {}
    world, batch, accumulate = int(payload.get("world_size", 1)), int(cfg.get("batch_size", 32)), int(cfg.get("accumulate", 1))
    old_batch = world * batch * accumulate
    if step and data_size is not None and old_batch != global_batch:
        raise DdpkitError(
            f"{path} was written by an earlier ddpkit, which kept its place in epoch {epoch + 1} as {step} steps of a global "
            f"batch of {old_batch} ({world} processes x --batch-size {batch} x --accumulate {accumulate}); this run's global "
            f"batch is {global_batch}, so that place cannot be turned into samples exactly: resume once with {world} "
            f"processes, --batch-size {batch} and --accumulate {accumulate} (its next checkpoint keeps the place in samples, "
            "which resumes at any world size)")
    per_epoch = -(-data_size // old_batch) if data_size is not None else 0
    samples = min(data_size, step * old_batch) if data_size is not None else step * old_batch
    global_step = int(payload.get("global_step") or epoch * per_epoch + step)
    return Position(epoch, samples, loss, count, global_step, old_batch)
