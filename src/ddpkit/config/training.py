"""The task, its data and the optimization: how long, how big, which learning rate and schedule,
on which device; and the settings of `ddpkit verify` that have no flag."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import DdpkitError
from .settings import TRAINING, Section, choice, positive, setting
from .values import parse_batch_size, parse_task_arg

BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
LR_SCHEDULES = ("constant", "linear", "cosine", "wsd")
DATA_PLACEMENTS = ("auto", "on", "off")  # --data-on-device (data/placement.py)


SEED_LIMIT = 2**31  # seed + 1 + rank (and verify's seed + 7919) stays below NumPy's 2**32


@dataclass(frozen=True)
class Training(Section):
    """What to train, for how long, at which batch size and learning rate, on which device."""

    GROUP = TRAINING

    task: str = setting("wine", "wine (default), digits, MODULE:FUNCTION or FILE.py:FUNCTION", positional=True)
    task_args: dict[str, Any] = setting(
        help="a keyword argument of the task function, KEY=VALUE (VALUE a Python literal or text); repeat for several",
        flag="--task-arg",
        metavar="KEY=VALUE",
        type=parse_task_arg,
        append=True,
        factory=dict,
    )
    epochs: int = setting(100, "epochs to train")
    batch_size: int | str = setting(
        32,
        "batch size PER PROCESS, as in the guide; the global batch is nproc x this (with --global-batch-size: "
        "the largest micro-batch); auto: the largest the memory plan fits, confirmed by one measured step "
        "(kept on --resume)",
        type=parse_batch_size,
        metavar="N|auto",
    )
    global_batch_size: int | None = setting(
        None,
        "samples per optimizer step at ANY world size: each process's share of G is cut into micro-batches of at "
        "most --batch-size, accumulated (recomputed at every start), so a resume on fewer or more processes "
        "continues the same sequence of global batches",
        type=int,
        metavar="G",
        default_help="nproc x --batch-size x --accumulate",
    )
    lr: float | None = setting(None, "learning rate", type=float, default_help="the task's own; Wine: 1e-3")
    seed: int = setting(0, "seed for the model and the sample order; same seed = same result at any --nproc")
    shuffle: bool = setting(True, "train in data-set order", flag="--no-shuffle")
    eval_every: int = setting(1, "evaluate the held-out split every N epochs")
    max_steps: int | None = setting(None, "stop after this many optimizer steps in all (overrides --epochs)", type=int)
    eval_every_steps: int | None = setting(None, "also evaluate every N optimizer steps, inside epochs", type=int)
    lr_schedule: str = setting(
        "constant",
        "the learning rate over the run's optimizer steps, after --warmup-steps of linear "
        "warm-up: constant, linear or cosine to --min-lr, or wsd (stable, then linear to --min-lr "
        "over the last --decay-fraction); a Task.scheduler replaces it",
        choices=LR_SCHEDULES,
    )
    warmup_steps: int = setting(0, "optimizer steps of linear warm-up from 0 to the learning rate")
    min_lr: float = setting(
        0.0,
        "the learning rate linear, cosine and wsd end at (an absolute value, e.g. lr / 10 as in "
        "nanoGPT); other parameter groups end at the same fraction of theirs",
        type=float,
    )
    decay_fraction: float | None = setting(
        None,
        "wsd: the fraction of the run's optimizer steps spent decaying, linearly to --min-lr, at its end",
        type=float,
        default_help="0.2",
    )
    clip_grad_norm: float | None = setting(
        None,
        "clip the gradients' global 2-norm (over every rank and shard) to this before each optimizer step "
        "(on a GPU: reads the norm on the host, one more synchronisation per step)",
        type=float,
    )
    num_workers: int = setting(
        0,
        "DataLoader worker processes per rank for data sets that are not in-memory tensors (a TensorDataset is "
        "batched by indexing its tensors, without workers)",
    )
    data_on_device: str = setting(
        "auto",
        "keep a training set of tensors (TensorDataset) on the device and index each batch there: the same "
        "samples in the same order, without a copy per step; on: whatever its size; off: gathered on the host "
        "and copied",
        choices=DATA_PLACEMENTS,
        default_help="auto: when its tensors take at most a tenth of the device's memory (--device-memory), "
        "always on a CPU",
    )
    backend: str = setting(
        "auto", "process-group backend", choices=BACKENDS, default_help="auto: nccl with GPUs, gloo on CPU"
    )
    device: str = setting("auto", "device", choices=DEVICES, default_help="auto: cuda when a GPU is visible")
    extra: dict[str, Any] = setting(help="free-form settings for user tasks", cli=False, factory=dict)
    # `ddpkit verify`'s own (no flag): the parameters after every optimizer step in RUN_DIR/trace,
    # and the model with its floating inputs in float64, so that rounding cannot hide or fake a drift
    trace_steps: bool = setting(False, "write the parameters after every optimizer step to RUN_DIR/trace", cli=False)
    float64: bool = setting(False, "train the model and its floating inputs in float64", cli=False)
    dropout_off: bool = setting(False, "turn the model's dropout modules off (p = 0)", cli=False)
    draws_seed: int | None = setting(
        None, "seed the per-rank random streams (dropout, augmentation) from this, not from --seed", cli=False
    )

    def check(self) -> None:
        if not self.task:
            raise DdpkitError("no task given: name a built-in task (wine, digits) or MODULE:FUNCTION")
        if not isinstance(self.task_args, dict):
            raise DdpkitError(
                "task_args must be a dict of keyword arguments for the task function, got "
                f"{type(self.task_args).__name__}"
            )
        positive("--epochs", self.epochs)
        if self.batch_size != "auto":
            positive("--batch-size", self.batch_size)
        if self.global_batch_size is not None:
            positive("--global-batch-size", self.global_batch_size)
        positive("--eval-every", self.eval_every)
        for flag, value in (("--max-steps", self.max_steps), ("--eval-every-steps", self.eval_every_steps)):
            if value is not None:
                positive(flag, value)
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise DdpkitError(
                f"--warmup-steps must be 0 or a positive number of optimizer steps, got {self.warmup_steps!r}"
            )
        choice("--lr-schedule", self.lr_schedule, LR_SCHEDULES)
        self._check_schedule()
        if self.clip_grad_norm is not None and not (
            isinstance(self.clip_grad_norm, (int, float)) and self.clip_grad_norm > 0
        ):
            raise DdpkitError(
                f"--clip-grad-norm must be a positive norm such as 1.0, got {self.clip_grad_norm!r} "
                "(leave it out not to clip)"
            )
        if self.lr is not None and not self.lr > 0:
            raise DdpkitError(f"--lr must be positive, got {self.lr}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < SEED_LIMIT:
            # NumPy takes seeds below 2**32 only, and each rank's streams are seeded from seed + 1 + rank
            raise DdpkitError(f"--seed must be an integer from 0 to {SEED_LIMIT - 1}, got {self.seed!r}")
        if self.num_workers < 0:
            raise DdpkitError(f"--num-workers must be 0 or more, got {self.num_workers}")
        choice("--data-on-device", self.data_on_device, DATA_PLACEMENTS)
        choice("--backend", self.backend, BACKENDS)
        choice("--device", self.device, DEVICES)
        if self.backend == "nccl" and self.device == "cpu":
            raise DdpkitError(
                "--backend nccl needs --device cuda (NCCL only moves GPU tensors); use --backend gloo for CPU"
            )

    def _check_schedule(self) -> None:
        """--min-lr and --decay-fraction against the schedule they shape."""
        if not (isinstance(self.min_lr, (int, float)) and self.min_lr >= 0):
            raise DdpkitError(f"--min-lr must be 0 or a positive learning rate, got {self.min_lr!r}")
        if self.min_lr and self.lr_schedule == "constant":
            raise DdpkitError(
                "--min-lr is where --lr-schedule linear, cosine or wsd ends; the constant schedule never "
                "decays: add --lr-schedule cosine (or linear, wsd), or drop --min-lr"
            )
        if self.lr is not None and self.min_lr and not self.min_lr < self.lr:
            raise DdpkitError(f"--min-lr {self.min_lr:g} must be below --lr {self.lr:g}")
        if self.decay_fraction is not None:
            if not (isinstance(self.decay_fraction, (int, float)) and 0 < self.decay_fraction <= 1):
                raise DdpkitError(
                    "--decay-fraction must be in (0, 1], the share of the run spent decaying, got "
                    f"{self.decay_fraction!r}"
                )
            if self.lr_schedule != "wsd":
                raise DdpkitError(
                    "--decay-fraction sets the decay of --lr-schedule wsd: add --lr-schedule wsd, or drop it"
                )
