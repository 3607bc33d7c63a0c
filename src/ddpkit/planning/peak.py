"""One rank's figures under one strategy: the activations a micro-batch keeps for backward
(ActivationEstimate, measured by ddpkit plan or --dry-run with one forward of the task's first
samples: training/probe.py) and what its peak is made of (Peak)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes one rank keeps for backward at `batch_size` samples per micro-batch (the same
    under DDP and FSDP: sharding splits the model, not the batch). `per_sample`: what each
    sample adds to (kept, kept_checkpointed, recomputed), so that `at(b)` gives another
    micro-batch's figures (activations are linear in the batch, as a transformer's are)."""

    batch_size: int
    kept: int  # everything autograd saves
    kept_checkpointed: int | None  # with checkpointing: what lies outside the blocks, and their inputs
    recomputed: int  # and, during backward, one block's recomputed activations at a time
    precision: str = "fp32"  # what the probe's forward ran in (bf16 and fp16: under autocast)
    per_sample: tuple[int, int, int] = (0, 0, 0)
    # bf16 and fp16 under FSDP, whose mixed precision runs each unit in half precision (no autocast)
    sharded: ActivationEstimate | None = None
    on_meta: bool = False  # probed on the meta device (a large model built there): bf16 as the model cast

    def need(self, checkpointing: bool) -> int:
        """The most a step holds: what is kept, and during backward the gradients of one block's
        activations on their way through it (and, checkpointed, that block's recomputed ones)."""
        if checkpointing and self.kept_checkpointed is not None:
            return self.kept_checkpointed + 2 * self.recomputed
        return self.kept + self.recomputed

    def at(self, batch_size: int) -> ActivationEstimate:
        """The same estimate at another micro-batch."""
        more = batch_size - self.batch_size
        grow = lambda value, per: max(0, value + more * per)  # noqa: E731
        ckpt = None if self.kept_checkpointed is None else grow(self.kept_checkpointed, self.per_sample[1])
        return dataclasses.replace(
            self,
            batch_size=batch_size,
            kept=grow(self.kept, self.per_sample[0]),
            kept_checkpointed=ckpt,
            recomputed=grow(self.recomputed, self.per_sample[2]),
            sharded=self.sharded.at(batch_size) if self.sharded is not None else None,
        )

    def of(self, sharded: bool) -> ActivationEstimate:
        """The figures under a sharded strategy (FSDP's mixed precision) or a whole replica."""
        return self.sharded if sharded and self.sharded is not None else self


@dataclass(frozen=True)
class Peak:
    """What one rank's peak is made of under one strategy: in training, the fixed cost, the
    model state, what is in flight and the activations of a micro-batch (or, when larger, the
    gradients FSDP makes again in each backward as they go); after the last step,
    rank 0 writes model.pt beside the state it still holds (`end_of_run`:
    that state and, under FSDP, the one tensor it has gathered at a time). The peak is the larger
    of the two."""

    fixed: int
    state: int
    transient: int
    activations: int | None  # None: not estimated (no --batch-size given to the plan)
    end_of_run: int
    grads_made: int = 0  # gradients made during backward while the activations go (FSDP's shards)

    @property
    def training(self) -> int:
        return self.fixed + self.state + self.transient + max(self.activations or 0, self.grads_made)

    @property
    def total(self) -> int:
        return max(self.training, self.fixed + self.end_of_run)
