"""RunConfig: every setting of a run in one frozen dataclass, grouped by concern and validated
once, each group by its own check (config_groups.py)."""

from __future__ import annotations

import dataclasses
import importlib.util  # noqa: F401  (config.importlib.util: where a test hides the tensorboard package)
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .config_groups import (  # noqa: F401  (re-exported: the choices and rules other layers name)
    BACKENDS,
    CONTRADICTIONS,
    DEVICES,
    EXPORT_FORMATS,
    FAULTS,
    FUSED_MODES,
    GRAD_COMPRESSIONS,
    GRAD_SYNC_MODES,
    LR_SCHEDULES,
    NODES,
    ON_NAN_MODES,
    OUTPUT,
    PERFORMANCE,
    PRECISIONS,
    PROCESSES,
    PROGRESS_MODES,
    RDZV_BACKENDS,
    START_METHODS,
    STRATEGY,
    TRACKERS,
    TRAINING,
    VALIDATIONS,
)
from .config_values import BatchPlan, format_bytes, parse_memory, parse_nproc, parse_task_arg  # noqa: F401
from .errors import DdpkitError
from .strategy_config import FSDP_NEEDS_TWO, STRATEGIES, StrategyConfig, strategy_help  # noqa: F401  (re-exported)

DEFAULT_TIMEOUT_S = 300.0


def setting(
    default: Any = None,
    help: str = "",
    *,
    group: str = TRAINING,
    choices: Sequence[str] | None = None,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    metavar: str | None = None,
    type: Any = None,
    default_help: str | None = None,
    positional: bool = False,
    nargs: str | None = "?",
    cli: bool = True,
    factory: Any = None,
    append: bool = False,
) -> Any:
    """A field with what the CLI needs to offer it as a flag: the help text, the choices and
    the default are written here once; cli/flags.py makes the flag from them (for RunConfig
    and for each command's own options, cli/NAME_cmd.py). `default_help` describes a default
    that is not a plain value ("one per GPU"); `append`: the flag may be repeated, its values
    collected in a list (RunConfig makes --task-arg's (key, value) pairs a dict); `nargs`: how
    many values a positional takes, as argparse counts them (None: exactly one)."""
    meta = {
        "help": help,
        "group": group,
        "choices": choices,
        "flag": flag,
        "aliases": aliases,
        "metavar": metavar,
        "type": type,
        "default_help": default_help,
        "positional": positional,
        "nargs": nargs,
        "cli": cli,
        "append": append,
    }
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def flag_spellings(f: dataclasses.Field) -> tuple[str, ...]:
    """The spellings of a setting's flag: its own (--the-name by default), then its aliases (the
    CLI's flags, a config file's keys and the flags `ddpkit slurm` keeps out of a job all read them)."""
    return (f.metadata.get("flag") or "--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ()))


@dataclass(frozen=True)
class RunConfig:
    """What to train and how. Built by the CLI or the Python API, read by every worker.
    Every field's help, choices and default live here; the CLI's flags are made from them."""

    task: str = setting("wine", "wine (default), digits, MODULE:FUNCTION or FILE.py:FUNCTION", positional=True)
    task_args: dict[str, Any] = setting(
        help="a keyword argument of the task function, KEY=VALUE (VALUE a Python literal or text); repeat for several",
        flag="--task-arg",
        metavar="KEY=VALUE",
        type=parse_task_arg,
        append=True,
        factory=dict,
    )
    # processes
    nproc: int | None = setting(
        None,
        "worker processes on this node",
        group=PROCESSES,
        aliases=("--nproc-per-node", "--nproc_per_node"),
        metavar="N|auto",
        type=parse_nproc,
        default_help="auto: one per GPU; 2 on a machine without GPUs",
    )
    max_restarts: int = setting(
        0,
        "restart all workers this many times after a failure (train: they resume from the newest "
        "checkpoint; launch: the script starts again from its beginning, continuing only from a "
        "checkpoint it loads itself); a line says so at each restart",
        group=PROCESSES,
        aliases=("--max_restarts",),
    )
    threads: int | None = setting(
        None, "CPU threads per process", group=PROCESSES, type=int, default_help="cores / processes"
    )
    start_method: str = setting(
        "auto",
        "how workers are created: fork (fast, CPU only) or spawn",
        group=PROCESSES,
        choices=START_METHODS,
        default_help="auto: fork on CPU, spawn with GPUs",
        aliases=("--start_method",),
    )
    timeout: float = setting(
        DEFAULT_TIMEOUT_S,
        "seconds any collective or rendezvous may wait before the job fails instead of hanging "
        "(launch: the default timeout of the script's own process group; one the script passes "
        "to init_process_group itself stands)",
        group=PROCESSES,
    )
    hang_timeout: float | None = setting(
        None,
        "seconds a rank may make no progress (no forward pass, no collective completed; launch: "
        "no collective completed and the main thread on the same line) before every rank dumps "
        "its Python stacks and last collectives into RUN_DIR/hang (launch: ddpkit-hang-RDZV_ID in "
        "the working directory, or in --log-dir), the report names the rank that hung, and the "
        "job stops; 0 = off (the dumps on a --timeout stay)",
        group=FAULTS,
        type=float,
        default_help="2 x --timeout (launch: x the script's own timeout); 0.9 x on NCCL, which aborts at it",
    )
    debug_collectives: bool = setting(
        False,
        "check across ranks that every collective matches (op, shapes, order) and name the rank that diverged (slow)",
        group=PROCESSES,
    )
    verbose: bool = setting(
        False,
        "show the elastic agent's own logs (rendezvous, restarts, failures); under train also what "
        "the task prints on every rank, whole lines, [rankN]: before those of ranks other than 0 "
        "(without it only rank 0's)",
        group=PROCESSES,
    )
    # torchrun's output and agent flags, same spellings and meaning (launchers/elastic.py)
    monitor_interval: float = setting(
        0.1, "seconds between the agent's checks of its workers", group=PROCESSES, aliases=("--monitor_interval",)
    )
    log_dir: str | None = setting(
        None,
        "keep every worker's stdout/stderr in files under this folder (LOG_DIR/RUN_ID/attempt_N/LOCAL_RANK/stdout.log)",
        group=PROCESSES,
        type=str,
        aliases=("--log_dir",),
    )
    redirects: str = setting(
        "0",
        "send workers' streams to log files only: 0 none, 1 stdout, 2 stderr, 3 both, or per local rank 0:3,1:0",
        group=PROCESSES,
        aliases=("-r",),
    )
    tee: str = setting(
        "",
        "streams written to log files and to the console, each line prefixed with its rank: 0-3 as --redirects",
        group=PROCESSES,
        aliases=("-t",),
        default_help="ddpkit launch: 3 with several local processes (lines never interleave), else 0",
    )
    local_ranks_filter: str = setting(
        "",
        "show only these local ranks' teed lines on the console, e.g. 0 or 0,1",
        group=PROCESSES,
        aliases=("--local_ranks_filter",),
        metavar="RANKS",
    )
    # where the other nodes are (torchrun's flags); one node by default
    nnodes: str = setting("1", "number of nodes, or MIN:MAX for an elastic job with --rdzv-endpoint", group=NODES)
    standalone: bool = setting(
        False, "one node, rendezvous on a free local port (torchrun's --standalone; ddpkit's default)", group=NODES
    )
    node_rank: int | None = setting(
        None,
        "this node's index, 0 on the master node (static rendezvous with --master-addr)",
        group=NODES,
        type=int,
        aliases=("--node_rank",),
    )
    master_addr: str | None = setting(
        None, "address of node 0 (static rendezvous)", group=NODES, type=str, aliases=("--master_addr",)
    )
    master_port: int | None = setting(
        None,
        "port on node 0 for the static rendezvous",
        group=NODES,
        type=int,
        default_help="29500",
        aliases=("--master_port",),
    )
    rdzv_backend: str | None = setting(
        None,
        "c10d or static; with torchrun's spellings, c10d + --master-addr meets at "
        "MASTER_ADDR:MASTER_PORT and static + --rdzv-endpoint at that endpoint",
        group=NODES,
        type=str,
        choices=RDZV_BACKENDS,
        aliases=("--rdzv_backend",),
        default_help="c10d with --rdzv-endpoint, static with --master-addr",
    )
    rdzv_conf: str = setting(
        "",
        "c10d rendezvous settings KEY=VALUE,... (is_host, join_timeout, last_call_timeout, "
        "close_timeout, keep_alive_interval, keep_alive_max_attempt, read_timeout)",
        group=NODES,
        aliases=("--rdzv_conf",),
        metavar="K=V,...",
    )
    rdzv_endpoint: str | None = setting(
        None,
        "c10d rendezvous: every node names the same HOST:PORT (hosted by the node that owns "
        "HOST); node ranks are assigned (a --node-rank is ignored, as torchrun does)",
        group=NODES,
        type=str,
        metavar="HOST:PORT",
        aliases=("--rdzv_endpoint",),
    )
    rdzv_id: str | None = setting(
        None,
        "job id shared by all nodes of a c10d rendezvous",
        group=NODES,
        type=str,
        default_help="derived from the endpoint",
        aliases=("--rdzv_id",),
    )
    local_addr: str | None = setting(
        None,
        "this node's address as the other nodes reach it",
        group=NODES,
        type=str,
        default_help="the address that routes to the master",
        aliases=("--local_addr",),
    )
    # training
    epochs: int = setting(100, "epochs to train")
    batch_size: int = setting(
        32,
        "batch size PER PROCESS, as in the guide; the global batch is nproc x this (with --global-batch-size: "
        "the largest micro-batch)",
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
    straggler_every: int = setting(
        100,
        "every N optimizer steps, compare where each rank's step time goes (data, compute, waiting) and name a "
        "rank slower than 1.2x the median (one small all-reduce per N steps; 0: only in the summary)",
        group=OUTPUT,
        metavar="N",
    )
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
    num_workers: int = setting(0, "DataLoader worker processes per rank for data sets that are not in-memory tensors")
    backend: str = setting(
        "auto", "process-group backend", choices=BACKENDS, default_help="auto: nccl with GPUs, gloo on CPU"
    )
    device: str = setting("auto", "device", choices=DEVICES, default_help="auto: cuda when a GPU is visible")
    # checkpoints, faults and signals
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
    run_dir: str | None = setting(
        None, "where model.pt, metrics.jsonl and checkpoints/ go", group=OUTPUT, type=str, default_help="runs/TASK-TIME"
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
        metavar="SIGNALS",
    )
    requeue: bool = setting(
        False,
        "under SLURM: after a --save-on-signal stop, requeue the job (it resumes with --auto-resume); "
        "not after TERM/INT, which end or requeue the job already",
        group=FAULTS,
    )
    on_nan: str = setting(
        "stop",
        "a NaN/inf loss stops the run before the weights are touched, or skips that step on every rank",
        group=FAULTS,
        choices=ON_NAN_MODES,
    )
    # output
    quiet: bool = setting(
        False, "no per-epoch progress or summary; only errors (the run directory still gets everything)", group=OUTPUT
    )
    progress: str = setting(
        "auto",
        "rank 0's progress: a tqdm bar, or plain lines for log files (on a GPU each refresh reads the running "
        "loss on the host: a synchronisation per refresh, not per step)",
        group=OUTPUT,
        choices=PROGRESS_MODES,
        default_help="auto: bar on a terminal",
    )
    csv: bool = setting(False, "also write RUN_DIR/metrics.csv (metrics.jsonl is always written)", group=OUTPUT)
    tensorboard: bool = setting(False, "also write TensorBoard event files to RUN_DIR/tensorboard", group=OUTPUT)
    export: str | None = setting(
        None,
        "at the end of the run, write the model to RUN_DIR/export/: safetensors files, or a folder "
        "Hugging Face's from_pretrained loads (hf; a transformers model); as `ddpkit export` does",
        group=OUTPUT,
        choices=EXPORT_FORMATS,
    )
    # experiment trackers (reporting/sinks/; README: Trackers): --csv and --tensorboard are two of them
    tracker: list[str] = setting(
        help="also send every metrics.jsonl record to this tracker, from rank 0; repeat for several",
        group=OUTPUT,
        choices=tuple(TRACKERS),
        append=True,
        type=str,
        factory=list,
    )
    tracker_uri: str | None = setting(
        None, "MLflow's tracking server (http://host:5000)", group=OUTPUT, type=str, default_help="$MLFLOW_TRACKING_URI"
    )
    experiment: str | None = setting(
        None,
        "the MLflow experiment or W&B project the run goes to",
        group=OUTPUT,
        type=str,
        default_help="$MLFLOW_EXPERIMENT_NAME or $WANDB_PROJECT, else the task's name",
    )
    # strategy and precision
    strategy: str = setting(
        "ddp",
        strategy_help(),  # the registered strategies' lines (strategy_config.py)
        group=STRATEGY,
        choices=STRATEGIES,  # read when asked: a strategy registered later is offered too
    )
    replicate: int | None = setting(
        None,
        "--strategy fsdp or hsdp: R replicas, each sharded over world size / R processes (must divide it; "
        "HSDP: only the replicas' gradient all-reduce crosses them)",
        group=STRATEGY,
        type=int,
        metavar="R",
        default_help="fsdp: 1; hsdp: one per node",
    )
    precision: str = setting(
        "fp32",
        "bf16: autocast (DDP) or bf16 compute with fp32 weights (FSDP); needs a GPU or CPU with "
        "bf16; fp16: autocast with a gradient scaler (DDP on a GPU)",
        group=STRATEGY,
        choices=PRECISIONS,
    )
    device_memory: int | None = setting(
        None,
        "memory per device for the plan and --strategy auto: 80GiB (2^30 bytes), 80GB (10^9), 512MB",
        group=STRATEGY,
        type=str,
        metavar="SIZE",
        default_help="detected",
    )
    init_from: str | None = setting(
        None,
        "start from pretrained weights: a safetensors file, a Hugging Face folder (model.safetensors or its "
        "sharded index) or a torch state dict; each process reads only the part it keeps",
        group=STRATEGY,
        type=str,
        metavar="PATH",
        default_help="the task's init_from, else none",
    )
    activation_checkpointing: bool = setting(
        False,
        "keep only each block's input through the forward and recompute the rest in backward: less "
        "activation memory for ~one more forward; per block (the FSDP units, or Task.checkpoint_blocks), "
        "under ddp and fsdp alike, same results",
        group=STRATEGY,
    )
    # performance knobs (strategies/ddp_knobs.py): what each changes in the result is documented there
    accumulate: int = setting(
        1,
        "K micro-batches of --batch-size per optimizer step, gradients all-reduced once (no_sync on the "
        "others); equals --batch-size K*b",
        group=PERFORMANCE,
        metavar="K",
    )
    grad_compression: str = setting(
        "none",
        "all-reduce gradients in 16 bits, or low-rank PowerSGD: less traffic, close but not equal results",
        group=PERFORMANCE,
        choices=GRAD_COMPRESSIONS,
    )
    grad_sync: str = setting(
        "auto",
        "how gradients are all-reduced: shm (shared memory, ranks on one machine's CPUs), backend "
        "(gloo/NCCL), auto: shm where it applies (CPU, one node), else the backend",
        group=PERFORMANCE,
        choices=GRAD_SYNC_MODES,
    )
    bucket_mb: float | None = setting(
        None, "DDP gradient bucket size in MB", group=PERFORMANCE, type=float, default_help="torch's 25"
    )
    static_graph: bool = setting(
        False, "tell DDP the model uses the same parameters every step (skips per-step graph checks)", group=PERFORMANCE
    )
    fused_optimizer: str = setting(
        "off",
        "rebuild torch Adam/AdamW/SGD with fused=True (one kernel over all parameters); auto: on with GPUs",
        group=PERFORMANCE,
        choices=FUSED_MODES,
    )
    compile: bool = setting(
        False, "torch.compile the model (slow first steps; needs a C++ compiler on CPU)", group=PERFORMANCE
    )
    extra: dict[str, Any] = setting(help="free-form settings for user tasks", cli=False, factory=dict)
    # `ddpkit verify`'s own (no flag): the parameters after every optimizer step in RUN_DIR/trace,
    # and the model with its floating inputs in float64, so that rounding cannot hide or fake a drift
    trace_steps: bool = setting(False, "write the parameters after every optimizer step to RUN_DIR/trace", cli=False)
    float64: bool = setting(False, "train the model and its floating inputs in float64", cli=False)
    dropout_off: bool = setting(False, "turn the model's dropout modules off (p = 0)", cli=False)
    draws_seed: int | None = setting(
        None, "seed the per-rank random streams (dropout, augmentation) from this, not from --seed", cli=False
    )

    def __post_init__(self) -> None:
        self._torchrun_spellings()
        if isinstance(self.device_memory, str):  # "80GB" from the Python API
            object.__setattr__(self, "device_memory", parse_memory(self.device_memory))
        if isinstance(self.task_args, (list, tuple)):  # (key, value) pairs from repeated --task-arg
            object.__setattr__(self, "task_args", dict(self.task_args))
        self._trackers()
        self.validate()

    def validate(self) -> None:
        """Each group of settings checks its own values (config_groups.py), in one fixed order."""
        for check in VALIDATIONS.values():
            check(self)

    def _trackers(self) -> None:
        """--tracker csv and --csv (tensorboard alike) are one setting: each sets the other."""
        chosen = [self.tracker] if isinstance(self.tracker, str) else list(self.tracker or ())
        chosen += [name for name in ("csv", "tensorboard") if getattr(self, name) is True]
        object.__setattr__(self, "tracker", list(dict.fromkeys(chosen)))
        for name in ("csv", "tensorboard"):
            if name in chosen:
                object.__setattr__(self, name, True)

    def _torchrun_spellings(self) -> None:
        """torchrun's ways of naming a rendezvous, as the ones ddpkit validates: --standalone
        is one node on a free port; c10d + --master-addr meets at MASTER_ADDR:MASTER_PORT;
        static + --rdzv-endpoint is that master; a --node-rank beside a c10d endpoint is
        ignored (the rendezvous assigns it), as torchrun ignores it."""

        def put(**kw: Any) -> None:
            for k, v in kw.items():
                object.__setattr__(self, k, v)

        if self.standalone:
            put(nnodes="1", rdzv_endpoint=None, master_addr=None, master_port=None, node_rank=None)
        if self.rdzv_backend == "c10d" and self.master_addr and not self.rdzv_endpoint:
            put(rdzv_endpoint=f"{self.master_addr}:{self.master_port or 29500}", master_addr=None, master_port=None)
        if self.rdzv_backend == "static" and self.rdzv_endpoint and not self.master_addr:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            put(
                master_addr=host or self.rdzv_endpoint,
                master_port=int(port) if port.isdigit() else None,
                rdzv_endpoint=None,
            )
        if self.rdzv_endpoint and self.node_rank is not None and not self.master_addr:
            put(node_rank=None)

    def rdzv_settings(self) -> dict[str, str]:
        """--rdzv-conf K=V,... as a dict (refused when malformed)."""
        out: dict[str, str] = {}
        for item in filter(None, (s.strip() for s in self.rdzv_conf.split(","))):
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise DdpkitError(f"--rdzv-conf must be KEY=VALUE,..., got {self.rdzv_conf!r}")
            out[key.strip()] = value.strip()
        return out

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

    def batch_plan(self, world_size: int) -> BatchPlan:
        """The global batch and accumulation at `world_size` (refused when G < world_size)."""
        return BatchPlan(self.batch_size, self.accumulate, self.global_batch_size, world_size)

    def strategy_config(self) -> StrategyConfig:
        """The strategy's settings, typed: what make_strategy and the strategies read."""
        return StrategyConfig(
            name=self.strategy,
            precision=self.precision,
            device_memory=self.device_memory,
            async_save=self.async_save,
            activation_checkpointing=self.activation_checkpointing,
            grad_sync=self.grad_sync,
            grad_compression=self.grad_compression,
            bucket_mb=self.bucket_mb,
            static_graph=self.static_graph,
            fused_optimizer=self.fused_optimizer,
            compile=self.compile,
            replicate=self.replicate,
        )

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
