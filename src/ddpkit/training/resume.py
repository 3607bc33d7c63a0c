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
           required: bool, quiet: bool = False) -> tuple[Position, dict[str, Any]]:
    """Where to continue from, and the checkpoint's extra state (scheduler, scaler). `required`
    (--resume): no checkpoint is an error; otherwise (--auto-resume) no checkpoint at all
    means a fresh start."""
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
    strategy.load_checkpoint(status, payload, Path(path), model, optimizer)
    rngs = payload["rng"]
    set_rng_state(rngs[rt.rank] if len(rngs) == rt.world_size else rngs[0])
    pos = Position(int(payload["epoch"]), int(payload.get("step", 0)), float(payload.get("loss_sum", 0.0)),
                   float(payload.get("count_sum", 0.0)), int(payload.get("global_step", 0)))
    if not quiet:
        where = f"epoch {pos.epoch} done" + (f", {pos.step} steps into epoch {pos.epoch + 1}" if pos.step else "")
        rt.print(f"ddpkit: resuming from {path} ({where})")
    return pos, payload.get("extra", {})
