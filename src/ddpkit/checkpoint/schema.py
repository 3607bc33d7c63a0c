"""The one schema of a checkpoint, written by both kinds (one file, or a folder of shards with
this header in its ddpkit.pt) and read by resume. Flat on disk, so that files written before
it read the same way."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import DdpkitError
from . import file as ckpt_file
from .state import Position


@dataclass
class Header:
    """The schema of a checkpoint of either kind (flat on disk: older files read the same way)."""

    position: Position
    parts: dict[str, Any] = field(default_factory=dict)
    rng: list[dict[str, Any]] = field(default_factory=list)
    world_size: int = 1
    config: dict[str, Any] = field(default_factory=dict)
    model_signature: dict[str, list[int]] = field(default_factory=dict)
    optimizer_groups: list[int] = field(default_factory=list)

    def to_dict(self, format: str = ckpt_file.FORMAT) -> dict[str, Any]:
        return {
            "format": format,
            "version": ckpt_file.VERSION,
            **self.position.fields(),
            "extra": self.parts,
            "rng": self.rng,
            "world_size": self.world_size,
            "config": self.config,
            "model_signature": self.model_signature,
            "optimizer_groups": self.optimizer_groups,
        }

    @classmethod
    def read(cls, payload: dict[str, Any], path: str, data_size: int | None, global_batch: int) -> Header:
        return cls(
            position_of(payload, path, data_size, global_batch),
            payload.get("extra") or {},
            payload["rng"],
            int(payload.get("world_size", 1)),
            payload.get("config") or {},
            payload.get("model_signature") or {},
            payload.get("optimizer_groups") or [],
        )


def position_of(payload: dict[str, Any], path: str, data_size: int | None, global_batch: int) -> Position:
    """The checkpoint's place in samples of the epoch's global order. A checkpoint written
    before places were kept in samples holds `step` steps of the global batch it was written
    with: exact in samples at that global batch only, so any other is refused, never guessed."""
    epoch, loss, count = (
        int(payload["epoch"]),
        float(payload.get("loss_sum", 0.0)),
        float(payload.get("count_sum", 0.0)),
    )
    if "samples" in payload:
        return Position(
            epoch,
            int(payload["samples"]),
            loss,
            count,
            int(payload.get("global_step", 0)),
            int(payload.get("global_batch", 0)),
        )
    step = int(payload.get("step", 0))
    cfg = payload.get("config") or {}
    world, batch, accumulate = (
        int(payload.get("world_size", 1)),
        int(cfg.get("batch_size", 32)),
        int(cfg.get("accumulate", 1)),
    )
    old_batch = world * batch * accumulate
    if step and data_size is not None and old_batch != global_batch:
        raise DdpkitError(
            f"{path} was written by an earlier ddpkit, which kept its place in epoch {epoch + 1} "
            f"as {step} steps of a global "
            f"batch of {old_batch} ({world} processes x --batch-size {batch} x --accumulate {accumulate}); "
            "this run's global "
            f"batch is {global_batch}, so that place cannot be turned into samples exactly: resume once with {world} "
            f"processes, --batch-size {batch} and --accumulate {accumulate} "
            "(its next checkpoint keeps the place in samples, "
            "which resumes at any world size)"
        )
    per_epoch = -(-data_size // old_batch) if data_size is not None else 0
    samples = min(data_size, step * old_batch) if data_size is not None else step * old_batch
    global_step = int(payload.get("global_step") or epoch * per_epoch + step)
    return Position(epoch, samples, loss, count, global_step, old_batch)
