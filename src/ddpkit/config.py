"""RunConfig: every setting of a run in one frozen dataclass, validated once, here."""
from __future__ import annotations

import dataclasses
import importlib.util
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import DdpkitError

BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
START_METHODS = ("auto", "fork", "spawn")
PROGRESS_MODES = ("auto", "bar", "lines")
STRATEGIES = ("ddp", "fsdp", "auto")
PRECISIONS = ("fp32", "bf16")
GRAD_SYNC_MODES = ("auto", "shm", "backend")  # how DDP gradients are all-reduced (shm_allreduce.py)
DEFAULT_TIMEOUT_S = 300.0
# Variables the launcher hands to its workers (here, so every side imports one name, cheaply).
ERROR_DIR_VAR = "DDPKIT_ERROR_DIR"  # where a worker writes a user error for the launcher to print
LAUNCH_TIME_VAR = "DDPKIT_LAUNCH_TIME"  # when the command started (the summary's wall time)
FSDP_NEEDS_TWO = ("--strategy fsdp shards the model across processes and needs at least 2 (--nproc 2 or more); "
                  "with one process use --strategy ddp")


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
    auto_resume: bool = False  # resume when the run dir has a checkpoint, else start fresh
    save_on_signal: str = ""  # e.g. "USR1,TERM": save at the next step boundary and stop
    requeue: bool = False  # under SLURM: after such a stop, `scontrol requeue` the job
    on_nan: str = "stop"  # a NaN/inf loss: "stop" the run, or "skip" that step on every rank
    backend: str = "auto"
    device: str = "auto"
    timeout: float = DEFAULT_TIMEOUT_S  # seconds any collective or rendezvous may wait
    threads: int | None = None  # per process; None: cores / local processes
    start_method: str = "auto"
    max_restarts: int = 0
    # where the other nodes are (torchrun's flags); one node by default
    nnodes: str = "1"  # "N", or "MIN:MAX" for an elastic c10d job
    node_rank: int | None = None  # static rendezvous: this node's index
    master_addr: str | None = None  # static rendezvous: node 0's address
    master_port: int | None = None
    rdzv_endpoint: str | None = None  # c10d rendezvous HOST:PORT (node ranks assigned at rendezvous)
    rdzv_id: str | None = None
    local_addr: str | None = None  # this node's address as the others reach it (default: derived)
    num_workers: int = 0  # DataLoader workers for datasets that are not in-memory tensors
    debug_collectives: bool = False  # every collective is checked across ranks (slow; for debugging hangs)
    quiet: bool = False
    verbose: bool = False
    progress: str = "auto"  # bar on a terminal (with tqdm), plain lines otherwise
    csv: bool = False  # also write RUN_DIR/metrics.csv
    tensorboard: bool = False  # also write TensorBoard event files to RUN_DIR/tensorboard
    # performance knobs (tuning.py): what each changes in the result is documented there
    grad_compression: str = "none"  # none | bf16 | fp16 | powersgd (DDP communication hook)
    grad_sync: str = "auto"  # auto | shm | backend: how DDP's gradients are all-reduced (shm_allreduce.py)
    accumulate: int = 1  # micro-batches of batch_size per optimizer step, no_sync on all but the last
    bucket_mb: float | None = None  # DDP bucket size (torch default 25)
    static_graph: bool = False
    compile: bool = False  # torch.compile the model
    fused_optimizer: str = "off"  # off | on | auto (on with GPUs): fused Adam/AdamW/SGD kernels
    extra: dict[str, Any] = field(default_factory=dict)  # free-form settings for user tasks
    strategy: str = "ddp"  # ddp | fsdp (shard model and optimizer) | auto (the memory plan picks)
    precision: str = "fp32"  # fp32 | bf16 (autocast under DDP, MixedPrecisionPolicy under FSDP)
    device_memory: int | None = None  # bytes per device for --strategy auto; None: detected

    def __post_init__(self) -> None:
        if isinstance(self.device_memory, str):  # "80GB" from the Python API
            object.__setattr__(self, "device_memory", parse_memory(self.device_memory))
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
        _choice("--on-nan", self.on_nan, ("stop", "skip"))
        _choice("--progress", self.progress, PROGRESS_MODES)
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise DdpkitError("--tensorboard needs the tensorboard package: pip install 'ddpkit[tensorboard]' (or tensorboard)")
        _choice("--grad-compression", self.grad_compression, ("none", "bf16", "fp16", "powersgd"))
        _choice("--fused-optimizer", self.fused_optimizer, ("off", "on", "auto"))
        _choice("--grad-sync", self.grad_sync, GRAD_SYNC_MODES)
        if self.grad_sync == "shm" and self.grad_compression != "none":
            raise DdpkitError(f"--grad-sync shm sums float32 gradients in shared memory; it cannot carry --grad-compression "
                              f"{self.grad_compression}. Drop one of them (--grad-sync auto picks the backend when compressing)")
        _positive("--accumulate", self.accumulate)
        if self.bucket_mb is not None and not (isinstance(self.bucket_mb, (int, float)) and self.bucket_mb > 0):
            raise DdpkitError(f"--bucket-mb must be a positive number of megabytes, got {self.bucket_mb!r}")
        if self.backend == "nccl" and self.device == "cpu":
            raise DdpkitError("--backend nccl needs --device cuda (NCCL only moves GPU tensors); use --backend gloo for CPU")
        if not self.task:
            raise DdpkitError("no task given: name a built-in task (wine, digits) or MODULE:FUNCTION")
        self._validate_nodes()
        if self.resume and not self.run_dir:
            raise DdpkitError("--resume needs --run-dir: the run directory whose checkpoints to continue from")
        _choice("--strategy", self.strategy, STRATEGIES)
        _choice("--precision", self.precision, PRECISIONS)
        if self.strategy == "fsdp" and self.nproc == 1 and not self.multi_node:
            raise DdpkitError(FSDP_NEEDS_TWO)
        if self.strategy == "fsdp":
            check_no_ddp_only_flags(self)
        if self.device_memory is not None and (not isinstance(self.device_memory, int) or self.device_memory < 1):
            raise DdpkitError(f"--device-memory must be a positive size such as 80GiB, got {self.device_memory!r}")

    @property
    def node_range(self) -> tuple[int, int]:
        lo, _, hi = self.nnodes.partition(":")
        return int(lo), int(hi or lo)

    @property
    def multi_node(self) -> bool:
        return self.node_range[1] > 1

    def _validate_nodes(self) -> None:
        try:
            lo, hi = self.node_range
        except ValueError:
            raise DdpkitError(f"--nnodes must be N or MIN:MAX, got {self.nnodes!r}") from None
        if lo < 1 or hi < lo:
            raise DdpkitError(f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {self.nnodes!r}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise DdpkitError(f"--master-port must be a TCP port (1-65535), got {self.master_port}")
        if self.rdzv_endpoint:
            if self.master_addr:
                raise DdpkitError("give either --rdzv-endpoint (c10d rendezvous) or --master-addr (static), not both")
            if self.node_rank is not None:
                raise DdpkitError("--node-rank is for a static rendezvous; with --rdzv-endpoint the rendezvous assigns node ranks: drop --node-rank")
            host, sep, port = self.rdzv_endpoint.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise DdpkitError(f"--rdzv-endpoint must be HOST:PORT, got {self.rdzv_endpoint!r}")
        elif self.multi_node:
            if lo != hi:
                raise DdpkitError("--nnodes MIN:MAX (elastic) needs a c10d rendezvous: give --rdzv-endpoint HOST:PORT")
            if not self.master_addr:
                raise DdpkitError(f"--nnodes {self.nnodes} needs --master-addr (node 0's address) and --node-rank, or --rdzv-endpoint HOST:PORT")
            if self.node_rank is None:
                raise DdpkitError(f"--nnodes {self.nnodes} with --master-addr needs --node-rank (0 on the master node, 1..{hi - 1} on the others)")
        if self.node_rank is not None and not 0 <= self.node_rank < hi:
            raise DdpkitError(f"--node-rank must be in 0..{hi - 1} for --nnodes {self.nnodes}, got {self.node_rank}")

    def replace(self, **changes: Any) -> "RunConfig":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(text: str | int | None) -> int | None:
    """--device-memory: '80GiB' (2^30 bytes), '80GB' (10^9), '512MB', or a number of bytes."""
    if text is None or isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m and _UNITS.get(m.group(2).lower())
    if not m or unit is None or float(m.group(1)) <= 0:
        raise DdpkitError(f"--device-memory must be a size such as 80GiB, 80GB or 512MB, got {text!r}")
    return int(float(m.group(1)) * unit)


def _positive(flag: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise DdpkitError(f"{flag} must be a positive integer, got {value!r}")


def check_no_ddp_only_flags(cfg: Any) -> None:
    """FSDP runs its own gradient reduce-scatter: DDP's knobs would be silently ignored, so refuse them."""
    ddp_only = [flag for flag, on in (
        ("--grad-compression", getattr(cfg, "grad_compression", "none") != "none"),
        ("--grad-sync shm", getattr(cfg, "grad_sync", "auto") == "shm"),
        ("--bucket-mb", getattr(cfg, "bucket_mb", None) is not None),
        ("--static-graph", getattr(cfg, "static_graph", False)),
        ("--compile", getattr(cfg, "compile", False)),
        ("--fused-optimizer on", getattr(cfg, "fused_optimizer", "off") == "on")) if on]
    if ddp_only:
        raise DdpkitError(f"{', '.join(ddp_only)}: DDP options, not available with --strategy fsdp; drop them or use --strategy ddp")


def _choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise DdpkitError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
