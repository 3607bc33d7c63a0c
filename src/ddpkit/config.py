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
PRECISIONS = ("fp32", "bf16", "fp16")
LR_SCHEDULES = ("constant", "linear", "cosine")
GRAD_SYNC_MODES = ("auto", "shm", "backend")  # how DDP gradients are all-reduced (strategies/grad_sync.py)
GRAD_COMPRESSIONS = ("none", "bf16", "fp16", "powersgd")
FUSED_MODES = ("off", "on", "auto")
ON_NAN_MODES = ("stop", "skip")
DEFAULT_TIMEOUT_S = 300.0
# Variables the launcher hands to its workers (here, so every side imports one name, cheaply).
ERROR_DIR_VAR = "DDPKIT_ERROR_DIR"  # where a worker writes a user error for the launcher to print
LAUNCH_TIME_VAR = "DDPKIT_LAUNCH_TIME"  # when the command started (the summary's wall time)
FSDP_NEEDS_TWO = ("--strategy fsdp shards the model across processes and needs at least 2 (--nproc 2 or more); "
                  "with one process use --strategy ddp")

# The groups of flags; each command of the CLI takes some of them (cli/flags.py).
PROCESSES = "processes"
NODES = "several nodes (run the same command on every node)"
TRAINING = "training"
FAULTS = "faults and signals"
OUTPUT = "output"
STRATEGY = "strategy and precision"
PERFORMANCE = "performance (see README: Performance)"


def setting(default: Any = None, help: str = "", *, group: str = TRAINING, choices: tuple[str, ...] | None = None,
            flag: str | None = None, aliases: tuple[str, ...] = (), metavar: str | None = None, type: Any = None,
            default_help: str | None = None, positional: bool = False, cli: bool = True, factory: Any = None,
            append: bool = False) -> Any:
    """A RunConfig field with what the CLI needs to offer it: the help text, the choices and
    the default are written here once; cli/flags.py makes the flag from them.
    `default_help` describes a default that is not a plain value ("one per GPU"); `append`:
    the flag may be repeated, each value parsed by `type` into a (key, value) pair of a dict."""
    meta = {"help": help, "group": group, "choices": choices, "flag": flag, "aliases": aliases, "metavar": metavar,
            "type": type, "default_help": default_help, "positional": positional, "cli": cli, "append": append}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def parse_nproc(value: str) -> int | None:
    """--nproc N|auto (None: auto)."""
    if value == "auto":
        return None
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"must be a positive integer or 'auto', got {value!r}") from None
    if n < 1:
        raise ValueError(f"must be a positive integer or 'auto', got {value!r}")
    return n


def parse_task_arg(text: str) -> tuple[str, Any]:
    """--task-arg KEY=VALUE: VALUE as a Python literal (4, 0.1, True, None, 'x', [1, 2]), else the text itself."""
    import ast

    key, sep, value = text.partition("=")
    if not sep or not key.strip().isidentifier():
        raise ValueError(f"must be KEY=VALUE with KEY a Python name, got {text!r}")
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        parsed = value
    return key.strip(), parsed


@dataclass(frozen=True)
class RunConfig:
    """What to train and how. Built by the CLI or the Python API, read by every worker.
    Every field's help, choices and default live here; the CLI's flags are made from them."""

    task: str = setting("wine", "wine (default), digits, MODULE:FUNCTION or FILE.py:FUNCTION", positional=True)
    task_args: dict[str, Any] = setting(help="a keyword argument of the task function, KEY=VALUE (VALUE a Python literal or text); "
                                        "repeat for several", flag="--task-arg", metavar="KEY=VALUE", type=parse_task_arg,
                                        append=True, factory=dict)
    # processes
    nproc: int | None = setting(None, "worker processes on this node", group=PROCESSES, aliases=("--nproc-per-node",),
                                metavar="N|auto", type=parse_nproc, default_help="auto: one per GPU; 2 on a machine without GPUs")
    max_restarts: int = setting(0, "restart all workers this many times after a failure; they resume from the newest checkpoint",
                                group=PROCESSES)
    threads: int | None = setting(None, "CPU threads per process", group=PROCESSES, type=int, default_help="cores / processes")
    start_method: str = setting("auto", "how workers are created: fork (fast, CPU only) or spawn", group=PROCESSES,
                                choices=START_METHODS, default_help="auto: fork on CPU, spawn with GPUs")
    timeout: float = setting(DEFAULT_TIMEOUT_S, "seconds any collective or rendezvous may wait before the job fails instead of hanging",
                             group=PROCESSES)
    hang_timeout: float | None = setting(None, "seconds a rank may make no progress (no forward pass, no collective completed) "
                                         "before every rank dumps its Python stacks and last collectives into RUN_DIR/hang, "
                                         "rank 0 prints which rank is stuck where, and the job stops; 0 = off (the dumps on "
                                         "a --timeout stay)", group=FAULTS, type=float,
                                         default_help="2 x --timeout; 0.9 x --timeout on NCCL, which aborts at --timeout")
    debug_collectives: bool = setting(False, "check across ranks that every collective matches (op, shapes, order) and name the "
                                      "rank that diverged (slow)", group=PROCESSES)
    verbose: bool = setting(False, "show the elastic agent's own logs (rendezvous, restarts, failures)", group=PROCESSES)
    # where the other nodes are (torchrun's flags); one node by default
    nnodes: str = setting("1", "number of nodes, or MIN:MAX for an elastic job with --rdzv-endpoint", group=NODES)
    node_rank: int | None = setting(None, "this node's index, 0 on the master node (static rendezvous with --master-addr)",
                                    group=NODES, type=int)
    master_addr: str | None = setting(None, "address of node 0 (static rendezvous)", group=NODES, type=str)
    master_port: int | None = setting(None, "port on node 0 for the static rendezvous", group=NODES, type=int, default_help="29500")
    rdzv_endpoint: str | None = setting(None, "c10d rendezvous: every node names the same HOST:PORT (hosted by the node that owns "
                                        "HOST); node ranks are assigned, no --node-rank", group=NODES, type=str, metavar="HOST:PORT")
    rdzv_id: str | None = setting(None, "job id shared by all nodes of a c10d rendezvous", group=NODES, type=str,
                                  default_help="random; give one for several nodes")
    local_addr: str | None = setting(None, "this node's address as the other nodes reach it", group=NODES, type=str,
                                     default_help="the address that routes to the master")
    # training
    epochs: int = setting(100, "epochs to train")
    batch_size: int = setting(32, "batch size PER PROCESS, as in the guide; the global batch is nproc x this")
    lr: float | None = setting(None, "learning rate", type=float, default_help="the task's own; Wine: 1e-3")
    seed: int = setting(0, "seed for the model and the sample order; same seed = same result at any --nproc")
    shuffle: bool = setting(True, "train in data-set order", flag="--no-shuffle")
    eval_every: int = setting(1, "evaluate the held-out split every N epochs")
    max_steps: int | None = setting(None, "stop after this many optimizer steps in all (overrides --epochs)", type=int)
    eval_every_steps: int | None = setting(None, "also evaluate every N optimizer steps, inside epochs", type=int)
    lr_schedule: str = setting("constant", "the learning rate over the run's optimizer steps, after --warmup-steps of linear "
                               "warm-up (a Task.scheduler replaces it)", choices=LR_SCHEDULES)
    warmup_steps: int = setting(0, "optimizer steps of linear warm-up from 0 to the learning rate")
    clip_grad_norm: float | None = setting(None, "clip the gradients' global 2-norm (over every rank and shard) to this before "
                                           "each optimizer step", type=float)
    num_workers: int = setting(0, "DataLoader worker processes per rank for data sets that are not in-memory tensors")
    backend: str = setting("auto", "process-group backend", choices=BACKENDS, default_help="auto: nccl with GPUs, gloo on CPU")
    device: str = setting("auto", "device", choices=DEVICES, default_help="auto: cuda when a GPU is visible")
    # checkpoints, faults and signals
    save_every: int = setting(50, "write a full checkpoint every N epochs, and at the end; 0 = final model only", group=FAULTS)
    save_every_steps: int | None = setting(None, "also write a checkpoint every N optimizer steps, inside epochs", group=FAULTS,
                                           type=int)
    run_dir: str | None = setting(None, "where model.pt, metrics.jsonl and checkpoints/ go", group=OUTPUT, type=str,
                                  default_help="runs/TASK-TIME")
    resume: bool = setting(False, "continue from the newest valid checkpoint in --run-dir", group=FAULTS)
    auto_resume: bool = setting(False, "continue from the newest checkpoint in --run-dir if there is one, else start fresh "
                                "(for requeued jobs)", group=FAULTS)
    save_on_signal: str = setting("", "on one of these signals (e.g. USR1,TERM) save a checkpoint at the next step boundary "
                                  "and stop", group=FAULTS, metavar="SIGNALS")
    requeue: bool = setting(False, "under SLURM: after a --save-on-signal stop, requeue the job (it resumes with --auto-resume)",
                            group=FAULTS)
    on_nan: str = setting("stop", "a NaN/inf loss stops the run before the weights are touched, or skips that step on every rank",
                          group=FAULTS, choices=ON_NAN_MODES)
    # output
    quiet: bool = setting(False, "no per-epoch progress or summary; only errors (the run directory still gets everything)",
                          group=OUTPUT)
    progress: str = setting("auto", "rank 0's progress: a tqdm bar, or plain lines for log files", group=OUTPUT,
                            choices=PROGRESS_MODES, default_help="auto: bar on a terminal")
    csv: bool = setting(False, "also write RUN_DIR/metrics.csv (metrics.jsonl is always written)", group=OUTPUT)
    tensorboard: bool = setting(False, "also write TensorBoard event files to RUN_DIR/tensorboard", group=OUTPUT)
    # strategy and precision
    strategy: str = setting("ddp", "ddp: a whole replica per process (fastest); fsdp: shard parameters, gradients and optimizer "
                            "state across processes (for models that do not fit); auto: the memory plan picks",
                            group=STRATEGY, choices=STRATEGIES)
    precision: str = setting("fp32", "bf16: autocast (DDP) or bf16 compute with fp32 weights (FSDP); needs a GPU or CPU with "
                             "bf16; fp16: autocast with a gradient scaler (DDP on a GPU)", group=STRATEGY, choices=PRECISIONS)
    device_memory: int | None = setting(None, "memory per device for the plan and --strategy auto: 80GiB (2^30 bytes), 80GB (10^9), "
                                        "512MB", group=STRATEGY, type=str, metavar="SIZE", default_help="detected")
    # performance knobs (strategies/ddp_knobs.py): what each changes in the result is documented there
    accumulate: int = setting(1, "K micro-batches of --batch-size per optimizer step, gradients all-reduced once (no_sync on the "
                              "others); equals --batch-size K*b", group=PERFORMANCE, metavar="K")
    grad_compression: str = setting("none", "all-reduce gradients in 16 bits, or low-rank PowerSGD: less traffic, close but not "
                                    "equal results", group=PERFORMANCE, choices=GRAD_COMPRESSIONS)
    grad_sync: str = setting("auto", "how gradients are all-reduced: shm (shared memory, ranks on one machine's CPUs), backend "
                             "(gloo/NCCL), auto: shm where it applies (CPU, one node), else the backend",
                             group=PERFORMANCE, choices=GRAD_SYNC_MODES)
    bucket_mb: float | None = setting(None, "DDP gradient bucket size in MB", group=PERFORMANCE, type=float, default_help="torch's 25")
    static_graph: bool = setting(False, "tell DDP the model uses the same parameters every step (skips per-step graph checks)",
                                 group=PERFORMANCE)
    fused_optimizer: str = setting("off", "rebuild torch Adam/AdamW/SGD with fused=True (one kernel over all parameters); "
                                   "auto: on with GPUs", group=PERFORMANCE, choices=FUSED_MODES)
    compile: bool = setting(False, "torch.compile the model (slow first steps; needs a C++ compiler on CPU)", group=PERFORMANCE)
    extra: dict[str, Any] = setting(help="free-form settings for user tasks", cli=False, factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.device_memory, str):  # "80GB" from the Python API
            object.__setattr__(self, "device_memory", parse_memory(self.device_memory))
        if isinstance(self.task_args, (list, tuple)):  # (key, value) pairs from repeated --task-arg
            object.__setattr__(self, "task_args", dict(self.task_args))
        self.validate()

    def validate(self) -> None:
        if self.nproc is not None and (not isinstance(self.nproc, int) or self.nproc < 1):
            raise DdpkitError(f"--nproc must be a positive integer or 'auto', got {self.nproc!r}")
        _positive("--epochs", self.epochs)
        _positive("--batch-size", self.batch_size)
        _positive("--eval-every", self.eval_every)
        for flag, value in (("--max-steps", self.max_steps), ("--eval-every-steps", self.eval_every_steps),
                            ("--save-every-steps", self.save_every_steps)):
            if value is not None:
                _positive(flag, value)
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise DdpkitError(f"--warmup-steps must be 0 or a positive number of optimizer steps, got {self.warmup_steps!r}")
        _choice("--lr-schedule", self.lr_schedule, LR_SCHEDULES)
        if self.clip_grad_norm is not None and not (isinstance(self.clip_grad_norm, (int, float)) and self.clip_grad_norm > 0):
            raise DdpkitError(f"--clip-grad-norm must be a positive norm such as 1.0, got {self.clip_grad_norm!r} "
                              "(leave it out not to clip)")
        if not isinstance(self.task_args, dict):
            raise DdpkitError(f"task_args must be a dict of keyword arguments for the task function, got {type(self.task_args).__name__}")
        if self.save_every < 0:
            raise DdpkitError(f"--save-every must be 0 (final model only) or a positive number of epochs, got {self.save_every}")
        if self.lr is not None and not self.lr > 0:
            raise DdpkitError(f"--lr must be positive, got {self.lr}")
        if not self.timeout > 0:
            raise DdpkitError(f"--timeout must be a positive number of seconds, got {self.timeout}")
        if self.hang_timeout is not None and not (isinstance(self.hang_timeout, (int, float)) and self.hang_timeout >= 0):
            raise DdpkitError(f"--hang-timeout must be 0 (off) or a positive number of seconds, got {self.hang_timeout!r}")
        if self.threads is not None:
            _positive("--threads", self.threads)
        if self.max_restarts < 0:
            raise DdpkitError(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        if self.num_workers < 0:
            raise DdpkitError(f"--num-workers must be 0 or more, got {self.num_workers}")
        _choice("--backend", self.backend, BACKENDS)
        _choice("--device", self.device, DEVICES)
        _choice("--start-method", self.start_method, START_METHODS)
        _choice("--on-nan", self.on_nan, ON_NAN_MODES)
        _choice("--progress", self.progress, PROGRESS_MODES)
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise DdpkitError("--tensorboard needs the tensorboard package: pip install 'ddpkit[tensorboard]' (or tensorboard)")
        _choice("--grad-compression", self.grad_compression, GRAD_COMPRESSIONS)
        _choice("--fused-optimizer", self.fused_optimizer, FUSED_MODES)
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
        if self.precision == "fp16" and self.strategy == "fsdp":
            raise DdpkitError("--precision fp16 needs a gradient scaler, which ddpkit offers under DDP only; "
                              "use --precision bf16 with --strategy fsdp")
        if self.device_memory is not None and (not isinstance(self.device_memory, int) or self.device_memory < 1):
            raise DdpkitError(f"--device-memory must be a positive size such as 80GiB, got {self.device_memory!r}")

    @property
    def node_range(self) -> tuple[int, int]:
        lo, _, hi = self.nnodes.partition(":")
        return int(lo), int(hi or lo)

    @property
    def hang_seconds(self) -> float:
        """--hang-timeout in seconds (0: the watchdog only answers requests)."""
        return 2 * self.timeout if self.hang_timeout is None else float(self.hang_timeout)

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

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
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


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


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
