"""RunConfig: every setting of a run, declared by concern. Each section is a frozen dataclass in
its own module (processes, nodes, training, faults, output, strategy, performance), with its
settings, their choices and the check of its own values; RunConfig is their union. Flags stay
flat on the command line, keys flat in config.json (and in a config file's tables, one per
section: config/file.py); `cfg.faults`, `cfg.output` and the like are the sections as views,
what each component is handed. Rules that span sections are RunConfig's own (`_across`)."""

from __future__ import annotations

import dataclasses
import importlib.util  # noqa: F401  (config.importlib.util: where a test hides the tensorboard package)
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import DdpkitError
from ..parallel.dims import check_degrees
from ..parallel.spec import FSDP_NEEDS_TWO, STRATEGIES, StrategyConfig, check, strategy_help  # noqa: F401
from .faults import ON_NAN_MODES, Faults  # noqa: F401
from .nodes import RDZV_BACKENDS, Nodes  # noqa: F401
from .output import EXPORT_FORMATS, PROGRESS_MODES, TRACKERS, Output, check_export_format  # noqa: F401
from .performance import FUSED_MODES, GRAD_COMPRESSIONS, GRAD_SYNC_MODES, Performance  # noqa: F401
from .processes import DEFAULT_TIMEOUT_S, START_METHODS, Processes  # noqa: F401
from .settings import (  # noqa: F401  (re-exported: the group titles and how a setting is declared)
    FAULTS,
    NODES,
    OUTPUT,
    PERFORMANCE,
    PROCESSES,
    STRATEGY,
    TRAINING,
    Section,
    flag_spellings,
    setting,
)
from .strategy import PRECISIONS, Strategy  # noqa: F401
from .training import BACKENDS, DEVICES, LR_SCHEDULES, Training  # noqa: F401
from .values import BatchPlan, format_bytes, parse_memory, parse_nproc, parse_task_arg  # noqa: F401

# Boolean settings that cannot both be on, with what each asks for: refused together when one
# place (the command line, a config file, the Python API) sets both; a flag on the command line
# switches off a config file's contradicting setting, as any flag wins over the file (cli/parser.py).
CONTRADICTIONS = {("quiet", "verbose"): "only errors, or every rank's output and the agent's logs"}


@dataclass(frozen=True)
class RunConfig(Performance, Strategy, Output, Nodes, Faults, Processes, Training):
    """What to train and how. Built by the CLI or the Python API, read by every worker.
    Every field's help, choices and default live in its section; the CLI's flags are made from
    them. The fields come in the sections' order: training, processes, faults, nodes, output,
    strategy, performance (dataclass fields follow the bases from the last to the first)."""

    def __post_init__(self) -> None:
        self._torchrun_spellings()
        if isinstance(self.device_memory, str):  # "80GB" from the Python API
            object.__setattr__(self, "device_memory", parse_memory(self.device_memory))
        if isinstance(self.task_args, (list, tuple)):  # (key, value) pairs from repeated --task-arg
            object.__setattr__(self, "task_args", dict(self.task_args))
        self._trackers()
        self.validate()

    # -- the sections, as their components receive them ----------------------------------------
    @property
    def training(self) -> Training:
        return Training.of(self)

    @property
    def processes(self) -> Processes:
        return Processes.of(self)

    @property
    def faults(self) -> Faults:
        return Faults.of(self)

    @property
    def nodes(self) -> Nodes:
        return Nodes.of(self)

    @property
    def output(self) -> Output:
        return Output.of(self)

    @property
    def performance(self) -> Performance:
        return Performance.of(self)

    def strategy_config(self) -> StrategyConfig:
        """The strategy section, typed as the strategies read it (with the performance knobs
        and --async-save, which the strategy decides on)."""
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
            tp=self.tp,
            pp=self.pp,
            pp_schedule=self.pp_schedule,
            pp_microbatches=self.pp_microbatches,
        )

    # -- checks -------------------------------------------------------------------------------
    def validate(self) -> None:
        """Each section checks its own values, then the rules that span sections, in one fixed
        order (the first problem found is the one reported)."""
        for check_group in VALIDATIONS.values():
            check_group(self)

    def _trackers(self) -> None:
        """--tracker csv and --csv (tensorboard alike) are one setting: each sets the other."""
        chosen = [self.tracker] if isinstance(self.tracker, str) else list(self.tracker or ())
        chosen += [name for name in ("csv", "tensorboard") if getattr(self, name) is True]
        object.__setattr__(self, "tracker", list(dict.fromkeys(chosen)))
        for name in ("csv", "tensorboard"):
            if name in chosen:
                object.__setattr__(self, name, True)

    # -- what spans sections ------------------------------------------------------------------
    @property
    def hang_seconds(self) -> float:
        """--hang-timeout in seconds (0: the watchdog only answers requests); twice --timeout by default."""
        return 2 * self.timeout if self.hang_timeout is None else float(self.hang_timeout)

    def batch_plan(self, world_size: int) -> BatchPlan:
        """The global batch and accumulation at `world_size` processes, cut among the data-parallel
        ones (world / (tp x pp): a tp group and a pipeline train one share together; refused when
        G is smaller than them). Before --batch-size auto has chosen (in the workers), at a
        micro-batch of 1: only what does not depend on it is checked."""
        check_degrees(world_size, self.tp, self.pp)
        micro = 1 if self.batch_size == "auto" else self.batch_size
        return BatchPlan(micro, self.accumulate, self.global_batch_size, world_size // (self.tp * self.pp))

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _training_across(cfg: RunConfig) -> None:
    """--global-batch-size against the performance section's --accumulate and the processes."""
    if cfg.global_batch_size is not None:
        if cfg.accumulate != 1:
            raise DdpkitError(
                "--global-batch-size sets the accumulation itself (each share in micro-batches of at most "
                "--batch-size): drop --accumulate"
            )
        if cfg.nproc is not None and not cfg.multi_node:
            cfg.batch_plan(cfg.nproc)  # G smaller than the processes: refused before launch
    check_batch_auto(cfg)


def check_batch_auto(cfg: RunConfig) -> None:
    """Refuse `--batch-size auto` where no memory plan can size it, in one line, before launch."""
    if cfg.batch_size != "auto":
        return
    if cfg.strategy == "auto":
        raise DdpkitError(
            "--batch-size auto with --strategy auto: auto fits the micro-batch you give it; name a strategy "
            "(--strategy ddp or fsdp) or give --batch-size"
        )
    from ..parallel.spec import strategy_spec

    if strategy_spec(cfg.strategy).memory is None:
        raise DdpkitError(
            f"--batch-size auto: --strategy {cfg.strategy} has no memory plan to size it; give --batch-size"
        )
    if cfg.tp > 1 or cfg.pp > 1:
        raise DdpkitError("--batch-size auto: the memory plan does not count --tp or --pp; give --batch-size")


def _faults_across(cfg: RunConfig) -> None:
    if cfg.resume and not cfg.run_dir:
        raise DdpkitError("--resume needs --run-dir: the run directory whose checkpoints to continue from")
    if cfg.pp > 1 and cfg.snapshot_every_steps:
        raise DdpkitError(
            f"--snapshot-every-steps with --pp {cfg.pp}: a pipeline's stages keep no snapshots in memory (a restart "
            "resumes from the newest disk checkpoint): give --save-every-steps instead"
        )


def _output_across(cfg: RunConfig) -> None:
    for (a, b), what in CONTRADICTIONS.items():
        if getattr(cfg, a) is True and getattr(cfg, b) is True:
            raise DdpkitError(
                f"--{a} and --{b} contradict each other ({what}): keep one (a flag given on the command "
                "line wins over a config file's contradicting setting)"
            )


def _strategy_across(cfg: RunConfig) -> None:
    """The strategies' one check (strategy_config.py, which the Python API and the own-loop
    Session call too), with this node's processes when they are known."""
    check(
        cfg.strategy_config(),
        None if cfg.nproc is None or cfg.multi_node else cfg.nproc,
        local_world_size=cfg.nproc if isinstance(cfg.nproc, int) else None,
    )


def _group_check(section: type[Section], across: Callable[[RunConfig], None] | None = None) -> Callable[[Any], None]:
    def run(cfg: Any) -> None:
        section.of(cfg).check()
        if across is not None:
            across(cfg)

    run.__doc__ = f"The {section.__name__} section's own check, then its rules across sections."
    return run


# Every group's check, in the order RunConfig runs them: the section's own, then its rules
# across sections (a unit test asks each group alone, and finds each rule in one group only).
VALIDATIONS: dict[str, Callable[[Any], None]] = {
    PROCESSES: _group_check(Processes),
    NODES: _group_check(Nodes),
    TRAINING: _group_check(Training, _training_across),
    FAULTS: _group_check(Faults, _faults_across),
    OUTPUT: _group_check(Output, _output_across),
    PERFORMANCE: _group_check(Performance),
    STRATEGY: _group_check(Strategy, _strategy_across),
}
