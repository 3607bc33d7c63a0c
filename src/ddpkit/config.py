"""RunConfig: every setting of a run in one frozen dataclass, validated once, here."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .errors import DdpkitError

BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
START_METHODS = ("auto", "fork", "spawn")
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class RunConfig:
    """What to train and how. Built by the CLI or the Python API, read by every worker."""

    task: str = "wine"
    nproc: int | None = None  # None: every GPU, or 2 CPU processes without GPUs
    epochs: int = 100
    batch_size: int = 32  # per process, as in the guide; global batch = nproc x batch_size
    lr: float | None = None  # None: the task's own learning rate
    seed: int = 0
    shuffle: bool = True
    save_every: int = 50  # epochs between checkpoints; 0 = final model only
    eval_every: int = 1
    run_dir: str | None = None
    resume: bool = False
    backend: str = "auto"
    device: str = "auto"
    timeout: float = DEFAULT_TIMEOUT_S  # seconds any collective or rendezvous may wait
    threads: int | None = None  # per process; None: cores / local processes
    start_method: str = "auto"
    max_restarts: int = 0
    num_workers: int = 0  # DataLoader workers for datasets that are not in-memory tensors
    quiet: bool = False
    verbose: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # free-form settings for user tasks

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.nproc is not None and (not isinstance(self.nproc, int) or self.nproc < 1):
            raise DdpkitError(f"--nproc must be a positive integer or 'auto', got {self.nproc!r}")
        _positive("--epochs", self.epochs)
        _positive("--batch-size", self.batch_size)
        _positive("--eval-every", self.eval_every)
        if self.save_every < 0:
            raise DdpkitError(f"--save-every must be 0 (final model only) or a positive number of epochs, got {self.save_every}")
        if self.lr is not None and not self.lr > 0:
            raise DdpkitError(f"--lr must be positive, got {self.lr}")
        if not self.timeout > 0:
            raise DdpkitError(f"--timeout must be a positive number of seconds, got {self.timeout}")
        if self.threads is not None:
            _positive("--threads", self.threads)
        if self.max_restarts < 0:
            raise DdpkitError(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        if self.num_workers < 0:
            raise DdpkitError(f"--num-workers must be 0 or more, got {self.num_workers}")
        _choice("--backend", self.backend, BACKENDS)
        _choice("--device", self.device, DEVICES)
        _choice("--start-method", self.start_method, START_METHODS)
        if self.backend == "nccl" and self.device == "cpu":
            raise DdpkitError("--backend nccl needs --device cuda (NCCL only moves GPU tensors); use --backend gloo for CPU")
        if not self.task:
            raise DdpkitError("no task given: name a built-in task (wine, digits) or MODULE:FUNCTION")
        if self.resume and not self.run_dir:
            raise DdpkitError("--resume needs --run-dir: the run directory whose checkpoints to continue from")

    def replace(self, **changes: Any) -> "RunConfig":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _positive(flag: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise DdpkitError(f"{flag} must be a positive integer, got {value!r}")


def _choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise DdpkitError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
