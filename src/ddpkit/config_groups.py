"""RunConfig's concerns (processes, nodes, training and data, checkpoints and faults, output,
performance, strategy and precision): each group's choices and the checks of its values,
one function per group. config.py declares the fields and runs every group's check once;
each check reads the settings as RunConfig's flat attributes."""

from __future__ import annotations

import importlib.util
import re
from typing import Any, Callable

from .errors import DdpkitError
from .strategy_config import check

# The groups of flags, as the CLI titles them; each command takes some of them (cli/flags.py).
PROCESSES = "processes"
NODES = "several nodes (run the same command on every node)"
TRAINING = "training"
FAULTS = "faults and signals"
OUTPUT = "output"
STRATEGY = "strategy and precision"
PERFORMANCE = "performance (see docs/performance.md)"

BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
START_METHODS = ("auto", "fork", "spawn", "forkserver")
RDZV_BACKENDS = ("c10d", "static")
PROGRESS_MODES = ("auto", "bar", "lines")
PRECISIONS = ("fp32", "bf16", "fp16")
LR_SCHEDULES = ("constant", "linear", "cosine", "wsd")
GRAD_SYNC_MODES = ("auto", "shm", "backend")  # how DDP gradients are all-reduced (strategies/grad_sync.py)
GRAD_COMPRESSIONS = ("none", "bf16", "fp16", "powersgd")
FUSED_MODES = ("off", "on", "auto")
ON_NAN_MODES = ("stop", "skip")
EXPORT_FORMATS = ("safetensors", "hf")  # what `ddpkit export` and train's --export write (checkpoint/export.py)
# --tracker's choices, each with the package (= ddpkit extra) it needs: the one list of trackers;
# each sink in reporting/sinks/ takes its name and package from here (a unit test holds them equal)
TRACKERS: dict[str, str | None] = {"mlflow": "mlflow", "wandb": "wandb", "tensorboard": "tensorboard", "csv": None}
# Boolean settings that cannot both be on, with what each asks for: refused together when one
# place (the command line, a config file, the Python API) sets both; a flag on the command line
# switches off a config file's contradicting setting, as any flag wins over the file (cli/parser.py).
CONTRADICTIONS = {("quiet", "verbose"): "only errors, or every rank's output and the agent's logs"}


def validate_processes(cfg: Any) -> None:
    """How many workers, how they start, wait and report (torchrun's output flags included)."""
    if cfg.nproc is not None and (not isinstance(cfg.nproc, int) or cfg.nproc < 1):
        raise DdpkitError(f"--nproc must be a positive integer or 'auto', got {cfg.nproc!r}")
    if not cfg.timeout > 0:
        raise DdpkitError(f"--timeout must be a positive number of seconds, got {cfg.timeout}")
    if cfg.threads is not None:
        _positive("--threads", cfg.threads)
    if cfg.max_restarts < 0:
        raise DdpkitError(f"--max-restarts must be 0 or more, got {cfg.max_restarts}")
    _choice("--start-method", cfg.start_method, START_METHODS)
    for flag, value in (("--redirects", cfg.redirects), ("--tee", cfg.tee or "0")):
        if not re.fullmatch(r"[0-3]|\d+:[0-3](,\d+:[0-3])*", value):
            raise DdpkitError(
                f"{flag} must be 0-3 (0 none, 1 stdout, 2 stderr, 3 both) or LOCAL_RANK:N,..., got {value!r}"
            )
    if cfg.local_ranks_filter and not re.fullmatch(r"\d+(,\d+)*", cfg.local_ranks_filter):
        raise DdpkitError(
            f"--local-ranks-filter must be local ranks separated by commas, e.g. 0,1; got {cfg.local_ranks_filter!r}"
        )
    if not (isinstance(cfg.monitor_interval, (int, float)) and cfg.monitor_interval > 0):
        raise DdpkitError(f"--monitor-interval must be a positive number of seconds, got {cfg.monitor_interval!r}")


def validate_nodes(cfg: Any) -> None:
    """Where the other nodes are: a static rendezvous (--master-addr, --node-rank) or c10d."""
    try:
        lo, hi = cfg.node_range
    except ValueError:
        raise DdpkitError(f"--nnodes must be N or MIN:MAX, got {cfg.nnodes!r}") from None
    if lo < 1 or hi < lo:
        raise DdpkitError(f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {cfg.nnodes!r}")
    if cfg.master_port is not None and not 0 < cfg.master_port < 65536:
        raise DdpkitError(f"--master-port must be a TCP port (1-65535), got {cfg.master_port}")
    if cfg.rdzv_endpoint:
        if cfg.master_addr:
            raise DdpkitError("give either --rdzv-endpoint (c10d rendezvous) or --master-addr (static), not both")
        if cfg.node_rank is not None:
            raise DdpkitError(
                "--node-rank is for a static rendezvous; with --rdzv-endpoint the rendezvous assigns node ranks: "
                "drop --node-rank"
            )
        host, sep, port = cfg.rdzv_endpoint.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise DdpkitError(f"--rdzv-endpoint must be HOST:PORT, got {cfg.rdzv_endpoint!r}")
    elif cfg.multi_node:
        if lo != hi:
            raise DdpkitError("--nnodes MIN:MAX (elastic) needs a c10d rendezvous: give --rdzv-endpoint HOST:PORT")
        if not cfg.master_addr:
            raise DdpkitError(
                f"--nnodes {cfg.nnodes} needs --master-addr (node 0's address) and --node-rank, "
                "or --rdzv-endpoint HOST:PORT"
            )
        if cfg.node_rank is None:
            raise DdpkitError(
                f"--nnodes {cfg.nnodes} with --master-addr needs --node-rank "
                f"(0 on the master node, 1..{hi - 1} on the others)"
            )
    if cfg.node_rank is not None and not 0 <= cfg.node_rank < hi:
        raise DdpkitError(f"--node-rank must be in 0..{hi - 1} for --nnodes {cfg.nnodes}, got {cfg.node_rank}")
    cfg.rdzv_settings()  # refuses a malformed --rdzv-conf


def validate_training(cfg: Any) -> None:
    """The task, its data and the optimization: how long, how big, which learning rate, where."""
    if not cfg.task:
        raise DdpkitError("no task given: name a built-in task (wine, digits) or MODULE:FUNCTION")
    if not isinstance(cfg.task_args, dict):
        raise DdpkitError(
            f"task_args must be a dict of keyword arguments for the task function, got {type(cfg.task_args).__name__}"
        )
    _positive("--epochs", cfg.epochs)
    _positive("--batch-size", cfg.batch_size)
    if cfg.global_batch_size is not None:
        _positive("--global-batch-size", cfg.global_batch_size)
        if cfg.accumulate != 1:
            raise DdpkitError(
                "--global-batch-size sets the accumulation itself (each share in micro-batches of at most "
                "--batch-size): drop --accumulate"
            )
        if cfg.nproc is not None and not cfg.multi_node:
            cfg.batch_plan(cfg.nproc)  # G smaller than the processes: refused before launch
    _positive("--eval-every", cfg.eval_every)
    if not isinstance(cfg.straggler_every, int) or cfg.straggler_every < 0:
        raise DdpkitError(f"--straggler-every must be 0 or a positive number of steps, got {cfg.straggler_every!r}")
    for flag, value in (("--max-steps", cfg.max_steps), ("--eval-every-steps", cfg.eval_every_steps)):
        if value is not None:
            _positive(flag, value)
    if not isinstance(cfg.warmup_steps, int) or cfg.warmup_steps < 0:
        raise DdpkitError(f"--warmup-steps must be 0 or a positive number of optimizer steps, got {cfg.warmup_steps!r}")
    _choice("--lr-schedule", cfg.lr_schedule, LR_SCHEDULES)
    validate_schedule(cfg)
    if cfg.clip_grad_norm is not None and not (isinstance(cfg.clip_grad_norm, (int, float)) and cfg.clip_grad_norm > 0):
        raise DdpkitError(
            f"--clip-grad-norm must be a positive norm such as 1.0, got {cfg.clip_grad_norm!r} "
            "(leave it out not to clip)"
        )
    if cfg.lr is not None and not cfg.lr > 0:
        raise DdpkitError(f"--lr must be positive, got {cfg.lr}")
    if cfg.num_workers < 0:
        raise DdpkitError(f"--num-workers must be 0 or more, got {cfg.num_workers}")
    _choice("--backend", cfg.backend, BACKENDS)
    _choice("--device", cfg.device, DEVICES)
    if cfg.backend == "nccl" and cfg.device == "cpu":
        raise DdpkitError(
            "--backend nccl needs --device cuda (NCCL only moves GPU tensors); use --backend gloo for CPU"
        )


def validate_schedule(cfg: Any) -> None:
    """--min-lr and --decay-fraction against the schedule they shape."""
    if not (isinstance(cfg.min_lr, (int, float)) and cfg.min_lr >= 0):
        raise DdpkitError(f"--min-lr must be 0 or a positive learning rate, got {cfg.min_lr!r}")
    if cfg.min_lr and cfg.lr_schedule == "constant":
        raise DdpkitError(
            "--min-lr is where --lr-schedule linear, cosine or wsd ends; the constant schedule never "
            "decays: add --lr-schedule cosine (or linear, wsd), or drop --min-lr"
        )
    if cfg.lr is not None and cfg.min_lr and not cfg.min_lr < cfg.lr:
        raise DdpkitError(f"--min-lr {cfg.min_lr:g} must be below --lr {cfg.lr:g}")
    if cfg.decay_fraction is not None:
        if not (isinstance(cfg.decay_fraction, (int, float)) and 0 < cfg.decay_fraction <= 1):
            raise DdpkitError(
                f"--decay-fraction must be in (0, 1], the share of the run spent decaying, got {cfg.decay_fraction!r}"
            )
        if cfg.lr_schedule != "wsd":
            raise DdpkitError("--decay-fraction sets the decay of --lr-schedule wsd: add --lr-schedule wsd, or drop it")


def validate_checkpoints(cfg: Any) -> None:
    """When checkpoints are written and kept, what a resume needs, and what a fault does."""
    if cfg.save_every < 0:
        raise DdpkitError(
            f"--save-every must be 0 (final model only) or a positive number of epochs, got {cfg.save_every}"
        )
    if cfg.save_every_steps is not None:
        _positive("--save-every-steps", cfg.save_every_steps)
    if cfg.save_every_minutes is not None and not (
        isinstance(cfg.save_every_minutes, (int, float)) and cfg.save_every_minutes > 0
    ):
        raise DdpkitError(f"--save-every-minutes must be a positive number of minutes, got {cfg.save_every_minutes!r}")
    if cfg.snapshot_every_steps is not None and not (
        isinstance(cfg.snapshot_every_steps, int) and cfg.snapshot_every_steps >= 0
    ):
        raise DdpkitError(
            f"--snapshot-every-steps must be 0 (off) or a number of optimizer steps, got {cfg.snapshot_every_steps!r}"
        )
    if cfg.keep_last is not None:
        _positive("--keep-last", cfg.keep_last)
    if cfg.keep_best is not None:
        _positive("--keep-best", cfg.keep_best)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(:(min|max))?", cfg.best_metric or ""):
        raise DdpkitError(
            f"--best-metric must be a metrics.jsonl name, optionally :min or :max (eval_accuracy:max), "
            f"got {cfg.best_metric!r}"
        )
    if cfg.resume and not cfg.run_dir:
        raise DdpkitError("--resume needs --run-dir: the run directory whose checkpoints to continue from")
    if cfg.hang_timeout is not None and not (isinstance(cfg.hang_timeout, (int, float)) and cfg.hang_timeout >= 0):
        raise DdpkitError(f"--hang-timeout must be 0 (off) or a positive number of seconds, got {cfg.hang_timeout!r}")
    _choice("--on-nan", cfg.on_nan, ON_NAN_MODES)


def validate_output(cfg: Any) -> None:
    """What rank 0 shows and which metric files it writes besides metrics.jsonl."""
    _choice("--progress", cfg.progress, PROGRESS_MODES)
    for (a, b), what in CONTRADICTIONS.items():
        if getattr(cfg, a) is True and getattr(cfg, b) is True:
            raise DdpkitError(
                f"--{a} and --{b} contradict each other ({what}): keep one (a flag given on the command "
                "line wins over a config file's contradicting setting)"
            )
    if cfg.tensorboard and importlib.util.find_spec(TRACKERS["tensorboard"]) is None:
        raise DdpkitError(
            "--tensorboard needs the tensorboard package: pip install 'ddpkit[tensorboard]' (or tensorboard)"
        )
    for name in cfg.tracker:
        _choice("--tracker", name, tuple(TRACKERS))
        package = TRACKERS[name]
        if package and importlib.util.find_spec(package) is None:
            raise DdpkitError(f"--tracker {name} needs the {package} package: pip install 'ddpkit[{package}]'")
    if cfg.tracker_uri and "mlflow" not in cfg.tracker:
        raise DdpkitError("--tracker-uri is MLflow's tracking server: add --tracker mlflow (or drop --tracker-uri)")
    if cfg.experiment and not {"mlflow", "wandb"} & set(cfg.tracker):
        raise DdpkitError(
            "--experiment names the MLflow experiment or W&B project: add --tracker mlflow or --tracker wandb "
            "(or drop --experiment)"
        )
    if cfg.export is not None:
        check_export_format("--export", cfg.export)


def check_export_format(flag: str, value: str) -> None:
    """An export's format, and the safetensors package it needs (refused before a run, not after)."""
    _choice(flag, value, EXPORT_FORMATS)
    if importlib.util.find_spec("safetensors") is None:
        raise DdpkitError(f"{flag} needs the safetensors package: pip install 'ddpkit[export]' (or safetensors)")


def validate_performance(cfg: Any) -> None:
    """DDP's knobs: micro-batches, gradient compression and sync, buckets, fused optimizers."""
    _choice("--grad-compression", cfg.grad_compression, GRAD_COMPRESSIONS)
    _choice("--fused-optimizer", cfg.fused_optimizer, FUSED_MODES)
    _choice("--grad-sync", cfg.grad_sync, GRAD_SYNC_MODES)
    if cfg.grad_sync == "shm" and cfg.grad_compression != "none":
        raise DdpkitError(
            f"--grad-sync shm sums float32 gradients in shared memory; it cannot carry --grad-compression "
            f"{cfg.grad_compression}. Drop one of them (--grad-sync auto picks the backend when compressing)"
        )
    _positive("--accumulate", cfg.accumulate)
    if cfg.bucket_mb is not None and not (isinstance(cfg.bucket_mb, (int, float)) and cfg.bucket_mb > 0):
        raise DdpkitError(f"--bucket-mb must be a positive number of megabytes, got {cfg.bucket_mb!r}")


def validate_strategy(cfg: Any) -> None:
    """DDP or FSDP, the precision, and what each refuses (the strategies' one check,
    strategy_config.py, which the Python API and the own-loop Session call too)."""
    _choice("--precision", cfg.precision, PRECISIONS)
    check(cfg.strategy_config(), None if cfg.nproc is None or cfg.multi_node else cfg.nproc)
    if cfg.device_memory is not None and (not isinstance(cfg.device_memory, int) or cfg.device_memory < 1):
        raise DdpkitError(f"--device-memory must be a positive size such as 80GiB, got {cfg.device_memory!r}")


# Every group's check, in the order RunConfig runs them (the first problem found is the one reported).
VALIDATIONS: dict[str, Callable[[Any], None]] = {
    PROCESSES: validate_processes,
    NODES: validate_nodes,
    TRAINING: validate_training,
    FAULTS: validate_checkpoints,
    OUTPUT: validate_output,
    PERFORMANCE: validate_performance,
    STRATEGY: validate_strategy,
}


def _positive(flag: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise DdpkitError(f"{flag} must be a positive integer, got {value!r}")


def _choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise DdpkitError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
