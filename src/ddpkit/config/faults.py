"""Checkpoints and faults: when checkpoints are written and which are kept, what a resume
needs, and what a hang, a signal, a requeue or a NaN does."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import DdpkitError
from .settings import FAULT_HANDLING, FAULTS, Section, choice, positive, setting

ON_NAN_MODES = ("stop", "skip")


@dataclass(frozen=True)
class Faults(Section):
    """Checkpoints (when, how many kept, resumed from where) and what a fault or a signal does."""

    GROUP = FAULTS

    hang_timeout: float | None = setting(
        None,
        "seconds a rank may make no progress (no forward pass, no collective completed; launch: "
        "no collective completed and the main thread on the same line) before every rank dumps "
        "its Python stacks and last collectives into RUN_DIR/hang (launch: ddpkit-hang-RDZV_ID in "
        "the working directory, or in --log-dir), the report names the rank that hung, and the "
        "job stops; 0 = off (the dumps on a --timeout stay)",
        group=FAULTS,
        help_group=FAULT_HANDLING,
        type=float,
        default_help="2 x --timeout (launch: x the script's own timeout); 0.9 x on NCCL, which aborts at it",
    )
    save_every: int = setting(
        50, "write a full checkpoint every N epochs, and at the end; 0 = final model only", group=FAULTS
    )
    save_every_steps: int | None = setting(
        None, "also write a checkpoint every N optimizer steps, inside epochs", group=FAULTS, type=int
    )
    save_every_minutes: float | None = setting(
        None,
        "also write a checkpoint when this many minutes have passed since the last "
        "(rank 0's clock, agreed at the next step)",
        group=FAULTS,
        type=float,
    )
    async_save: bool = setting(
        False,
        "write checkpoints in a background thread while training goes on (the state is copied to "
        "the CPU first; the next save waits for the last); DDP's one-file checkpoints",
        group=FAULTS,
    )
    snapshot_every_steps: int | None = setting(
        None,
        "with --max-restarts: keep the newest state in each node's memory (/dev/shm) every K optimizer steps, "
        "so that after a lost node or process the survivors resume from it rather than from the last disk "
        "checkpoint (FSDP/HSDP: each process keeps its own shards; used when every shard survived); 0 = off",
        group=FAULTS,
        type=int,
        metavar="K",
        default_help="auto: every step while a snapshot costs under 1/20 of a step (measured), else every few",
    )
    keep_last: int | None = setting(
        None,
        "keep only the K newest complete checkpoints (older ones are deleted after a newer one is complete)",
        group=FAULTS,
        type=int,
        metavar="K",
    )
    keep_best: int | None = setting(
        None,
        "also keep the B checkpoints with the best --best-metric (taken where an evaluation ran)",
        group=FAULTS,
        type=int,
        metavar="B",
    )
    best_metric: str = setting(
        "eval_loss",
        "the metrics.jsonl value that ranks checkpoints for --keep-best; NAME:max for one "
        "where higher is better (eval_accuracy:max)",
        group=FAULTS,
    )
    resume: bool = setting(False, "continue from the newest valid checkpoint in --run-dir", group=FAULTS)
    auto_resume: bool = setting(
        False,
        "continue from the newest checkpoint in --run-dir if there is one, else start fresh (for requeued jobs)",
        group=FAULTS,
    )
    save_on_signal: str = setting(
        "",
        "on one of these signals (e.g. USR1,TERM) save a checkpoint at the next step boundary and stop",
        group=FAULTS,
        help_group=FAULT_HANDLING,
        metavar="SIGNALS",
    )
    requeue: bool = setting(
        False,
        "under SLURM: after a --save-on-signal stop, requeue the job (it resumes with --auto-resume); "
        "not after TERM/INT, which end or requeue the job already",
        group=FAULTS,
        help_group=FAULT_HANDLING,
    )
    on_nan: str = setting(
        "stop",
        "a NaN/inf loss stops the run before the weights are touched, or skips that step on every rank",
        group=FAULTS,
        help_group=FAULT_HANDLING,
        choices=ON_NAN_MODES,
    )

    def check(self) -> None:
        if self.save_every < 0:
            raise DdpkitError(
                f"--save-every must be 0 (final model only) or a positive number of epochs, got {self.save_every}"
            )
        if self.save_every_steps is not None:
            positive("--save-every-steps", self.save_every_steps)
        if self.save_every_minutes is not None and not (
            isinstance(self.save_every_minutes, (int, float)) and self.save_every_minutes > 0
        ):
            raise DdpkitError(
                f"--save-every-minutes must be a positive number of minutes, got {self.save_every_minutes!r}"
            )
        if self.snapshot_every_steps is not None and not (
            isinstance(self.snapshot_every_steps, int) and self.snapshot_every_steps >= 0
        ):
            raise DdpkitError(
                "--snapshot-every-steps must be 0 (off) or a number of optimizer steps, got "
                f"{self.snapshot_every_steps!r}"
            )
        if self.keep_last is not None:
            positive("--keep-last", self.keep_last)
        if self.keep_best is not None:
            positive("--keep-best", self.keep_best)
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(:(min|max))?", self.best_metric or ""):
            raise DdpkitError(
                f"--best-metric must be a metrics.jsonl name, optionally :min or :max (eval_accuracy:max), "
                f"got {self.best_metric!r}"
            )
        if self.hang_timeout is not None and not (
            isinstance(self.hang_timeout, (int, float)) and self.hang_timeout >= 0
        ):
            raise DdpkitError(
                f"--hang-timeout must be 0 (off) or a positive number of seconds, got {self.hang_timeout!r}"
            )
        choice("--on-nan", self.on_nan, ON_NAN_MODES)
