"""The strategy's settings, typed, its rules, and the registry of strategies.

One `check` answers for RunConfig's validation (before launch), the launcher (api.py, once the
number of processes is known), the workers' make_strategy (the real world size, and what
`--strategy auto` chose) and the own-loop Session (rt.wrap's keywords). It imports no torch,
so `ddpkit --help` and the config stay instant; the strategies themselves live in strategies/.

Every strategy is a StrategySpec in one registry (`register`): its name, whether it shards,
its own rules, its memory model (what a rank holds, parallel/footprints.py), its help line, its
(replicate, shard) layout and where its Strategy is built (an import path, so FSDP's imports
stay lazy). `--strategy`'s choices and help, check(), strategy_for, `--strategy auto` and the
memory plan all read it. HSDP is FSDP with replicas: `--strategy fsdp --replicate R` lays it
out as R replicas of world size / R shards; `--strategy hsdp` spells the same with one replica
per node unless --replicate says otherwise.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ..errors import DdpkitError
from .dims import PP_SCHEDULES, ParallelDims, check_degrees
from .footprints import MemoryModel, sharded_state, whole_replica

FSDP_NEEDS_TWO = (
    "--strategy fsdp shards the model across processes and needs at least 2 (--nproc 2 or more); "
    "with one process use --strategy ddp"
)


@dataclass(frozen=True)
class StrategyConfig:
    """How the model is parallelised, as the strategies read it: built from a RunConfig by
    RunConfig.strategy_config(), or from rt.wrap's keywords by the Session."""

    name: str = "ddp"  # a registered strategy: ddp | fsdp | hsdp | auto (the memory plan picks, training/auto.py)
    precision: str = "fp32"
    device_memory: int | None = None  # bytes per device for the memory plan (None: detected)
    async_save: bool = False  # background checkpoints: one-file (DDP) checkpoints only
    activation_checkpointing: bool = False  # recompute each block's activations in backward (activation.py)
    # DDP's knobs (strategies/ddp_knobs.py); FSDP reduce-scatters by itself and refuses them
    grad_sync: str = "auto"
    grad_compression: str = "none"
    bucket_mb: float | None = None
    static_graph: bool = False
    fused_optimizer: str = "auto"  # on a GPU where the task chose neither fused nor foreach (ddp_knobs.py)
    compile: bool = False  # every strategy: the whole DDP model, else each block's forward (compiling.py)
    ddp_options: dict[str, Any] = field(default_factory=dict)  # DistributedDataParallel keywords (rt.wrap's)
    replicate: int | None = None  # hsdp's replicas (None: one per node); the shards are dp / replicate
    # the mesh's other dims (parallel/dims.py): world = dp x pp x tp, tp within a node
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved-1f1b
    pp_microbatches: int | None = None  # micro-batches per step through the pipeline (None: the schedule's default)

    def dp_world(self, world_size: int) -> int:
        """The data-parallel ranks among `world_size`: those that train different samples."""
        return max(1, world_size // (self.tp * self.pp))


def check(
    config: StrategyConfig,
    world_size: int | None = None,
    *,
    mesh_shape: tuple[int, int] | None = None,
    own_loop: bool = False,
    local_world_size: int | None = None,
) -> None:
    """Refuse what `config` cannot do with `world_size` processes (None: not known yet): the
    rules every strategy shares, then its own (StrategySpec.rules).

    `mesh_shape`: FSDP's (replicate, shard) device mesh, whose product must be the world size.
    `own_loop`: spell the messages as rt.wrap's keywords instead of the CLI's flags.
    `local_world_size`: one node's processes (a tp group stays within a node)."""
    spec = _named(config.name, own_loop)
    check_degrees(world_size, config.tp, config.pp, local_world_size)
    _check_pipeline(config)
    _check_tp(config)
    _check_replicate(config, spec, None if world_size is None else config.dp_world(world_size))
    if not spec.ddp_knobs:
        ddp_only = _ddp_only(config, own_loop)
        if ddp_only and own_loop:
            raise DdpkitError(
                f"rt.wrap(strategy={config.name!r}): {', '.join(ddp_only)} are DDP options; drop them or use "
                "strategy='ddp'"
            )
        if ddp_only:
            raise DdpkitError(
                f"{', '.join(ddp_only)}: DDP options, not available with --strategy {config.name}; drop them or use "
                "--strategy ddp"
            )
    if config.async_save and not spec.async_save:
        raise DdpkitError(
            "--async-save writes DDP's one-file checkpoints in the background; FSDP's sharded checkpoints are "
            "written by every rank together: drop --async-save with --strategy "
            + ("fsdp/auto" if config.name in ("fsdp", "auto") else config.name)
        )
    for rule in spec.rules:
        rule(config, world_size, own_loop)
    if mesh_shape is not None:
        _check_mesh(mesh_shape, None if world_size is None else config.dp_world(world_size))


def _check_tp(config: StrategyConfig) -> None:
    """--tp N > 1 is built with FSDP or HSDP over the data-parallel ranks (a (dp_replicate,
    dp_shard, tp) mesh) only."""
    tp = config.tp
    if tp > 1 and config.name in ("ddp", "auto"):
        raise DdpkitError(
            f"--tp {tp} with --strategy {config.name}: torch's DDP cannot replicate a model whose Linears are split "
            f"over the tp ranks (DTensor parameters); use --strategy fsdp --tp {tp} (or hsdp)"
        )


def _check_pipeline(config: StrategyConfig) -> None:
    """--pp-schedule and --pp-microbatches: a known schedule, a positive count."""
    if config.pp_schedule not in PP_SCHEDULES:
        raise DdpkitError(f"--pp-schedule must be one of {', '.join(PP_SCHEDULES)}, got {config.pp_schedule!r}")
    m = config.pp_microbatches
    if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
        raise DdpkitError(f"--pp-microbatches must be a positive number of micro-batches, got {m!r}")
    if config.pp > 1 and config.name != "ddp":
        raise DdpkitError(
            f"--strategy {config.name} with --pp {config.pp} is not built (a pipeline's stages replicate over the "
            "data-parallel ranks, as DDP does): use --strategy ddp"
        )
    for flag, on in (("--activation-checkpointing", config.activation_checkpointing), ("--compile", config.compile)):
        if config.pp > 1 and on:
            raise DdpkitError(f"{flag} with --pp is not built: drop one of them")


def mesh_dims(
    config: StrategyConfig, world_size: int, nnodes: int = 1, local_world_size: int | None = None, rank: int = 0
) -> ParallelDims:
    """The job's mesh (parallel/dims.py) as `config` lays it out over `world_size` ranks on
    `nnodes` nodes: tp and pp from the config, the data-parallel rest replicated (DDP) or laid
    out by the strategy's (replicate, shard) layout over the data-parallel ranks (FSDP, HSDP)."""
    check_degrees(world_size, config.tp, config.pp, local_world_size)
    spec = _REGISTRY.get(config.name)
    if spec is None or spec.layout is None:
        shards = spec is not None and spec.shards
        return ParallelDims.of(world_size, tp=config.tp, pp=config.pp, shards=shards, rank=rank)
    replicate, _ = dp_layout(config, world_size, nnodes, local_world_size)
    return ParallelDims.of(world_size, tp=config.tp, pp=config.pp, replicate=replicate, shards=True, rank=rank)


def dp_layout(
    config: StrategyConfig, world_size: int, nnodes: int = 1, local_world_size: int | None = None
) -> tuple[int, int]:
    """The strategy's (replicate, shard) layout of the data-parallel ranks among `world_size`: its
    layout asked about them alone, a node's share being its processes over tp (the pipeline's
    stages may span nodes). (1, dp) for a strategy without a layout."""
    spec = _REGISTRY.get(config.name)
    dp = config.dp_world(world_size)
    if spec is None or spec.layout is None:
        return 1, dp
    local = local_world_size // config.tp if local_world_size is not None and config.pp == 1 else None
    return spec.layout(config, dp, max(1, nnodes // config.pp), local)


def _named(name: str, own_loop: bool) -> StrategySpec:
    """The registered strategy `name`, or the one-line refusal naming the choices."""
    names = [s.name for s in _REGISTRY.values() if s.own_loop or not own_loop]
    if name not in names:
        raise DdpkitError(
            f"rt.wrap(strategy=...) must be {' or '.join(repr(n) for n in names)}, got {name!r}"
            if own_loop
            else f"--strategy must be one of {', '.join(names)}, got {name!r}"
        )
    return _REGISTRY[name]


def _sharded_precision(config: StrategyConfig, world_size: int | None, own_loop: bool) -> None:
    """FSDP's rule: fp16 needs a gradient scaler, which ddpkit offers under DDP only."""
    if config.precision == "fp16":
        raise DdpkitError(
            "precision='fp16' needs a gradient scaler, which ddpkit offers under DDP only; use 'bf16' with FSDP"
            if own_loop
            else "--precision fp16 needs a gradient scaler, which ddpkit offers under DDP only; "
            f"use --precision bf16 with --strategy {config.name}"
        )


def _needs_two(config: StrategyConfig, world_size: int | None, own_loop: bool) -> None:
    """FSDP's rule: shards need 2 or more processes to be spread over."""
    if world_size is not None and world_size < 2:
        raise DdpkitError(
            FSDP_NEEDS_TWO.replace("--nproc 2 or more", "start the script with 2 or more processes").replace(
                "--strategy ddp", "strategy='ddp'"
            )
            if own_loop
            else FSDP_NEEDS_TWO.replace("--strategy fsdp", f"--strategy {config.name}")
        )


def _ddp_only(config: StrategyConfig, own_loop: bool) -> list[str]:
    """The DDP settings given: FSDP would silently ignore them."""
    if own_loop:
        return [*config.ddp_options, *(["grad_sync"] if config.grad_sync != "auto" else [])]
    return [
        flag
        for flag, on in (
            ("--grad-compression", config.grad_compression != "none"),
            ("--grad-sync shm", config.grad_sync == "shm"),
            ("--bucket-mb", config.bucket_mb is not None),
            ("--static-graph", config.static_graph),
            ("--fused-optimizer on", config.fused_optimizer == "on"),
        )
        if on
    ]


def _check_mesh(shape: tuple[int, int], world_size: int | None) -> None:
    if not (isinstance(shape, tuple) and len(shape) == 2 and all(isinstance(n, int) and n >= 1 for n in shape)):
        raise DdpkitError(f"the device mesh must be two positive sizes (replicate, shard), got {shape!r}")
    if world_size is not None and shape[0] * shape[1] != world_size:
        raise DdpkitError(
            f"a device mesh of {shape[0]} x {shape[1]} (replicate x shard) holds {shape[0] * shape[1]} "
            f"processes, but the job has {world_size}: make replicate x shard equal the number of processes"
        )


def _check_replicate(config: StrategyConfig, spec: StrategySpec, world_size: int | None) -> None:
    """--replicate lays out FSDP's replicas (fsdp, hsdp): a positive divisor of the number of processes."""
    r = config.replicate
    if r is None:
        return
    if not spec.replicas:
        name = next((s.name for s in _REGISTRY.values() if s.replicas), "fsdp")
        raise DdpkitError(
            f"--replicate {r} sets the replicas of --strategy {name} (shard within a replica, all-reduce across "
            f"replicas); use --strategy {name} --replicate {r}, or drop --replicate"
        )
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise DdpkitError(f"--replicate must be a positive number of replicas, got {r!r}")
    if world_size is not None and world_size % r:
        raise DdpkitError(
            f"--replicate {r} does not divide the {world_size}{_dp_word(config)} processes into equal replicas: "
            f"choose a divisor of {world_size} (each replica holds world size / replicate shards)"
        )


def _dp_word(config: StrategyConfig) -> str:
    """How messages name the ranks --replicate divides: every process, or the data-parallel ones."""
    return " data-parallel" if config.tp * config.pp > 1 else ""


def fsdp_mesh(
    config: StrategyConfig, world_size: int, nnodes: int, local_world_size: int | None = None
) -> tuple[int, int]:
    """fsdp's (replicate, shard) mesh: every rank one shard, or with --replicate R (HSDP) R replicas
    of world_size / R shards each (R divides the world size: checked by _check_replicate)."""
    replicate = config.replicate or 1
    return replicate, world_size // replicate


def fsdp_note(mesh: tuple[int, int]) -> str | None:
    """What a run of fsdp with --replicate R > 1 gets, for rank 0 to print (nothing without replicas)."""
    replicate, shard = mesh
    if replicate == 1:
        return None
    return (
        f"--strategy fsdp --replicate {replicate}: {replicate} replicas x {shard} shards (HSDP: gradients "
        "all-reduced across replicas)"
    )


def hsdp_mesh(
    config: StrategyConfig, world_size: int, nnodes: int, local_world_size: int | None = None
) -> tuple[int, int]:
    """hsdp's (replicate, shard) mesh: --replicate R replicas of world_size / R shards, or by
    default one replica per node, sharded over that node's processes (global ranks are numbered
    node by node, so each shard group is one node and only the replicas' all-reduce crosses nodes).
    Every rank gets the same answer: it depends only on the job's world size and node count,
    which agree on every rank when every node runs `local_world_size` processes (checked)."""
    if config.replicate is None and local_world_size is not None and nnodes * local_world_size != world_size:
        raise DdpkitError(
            f"--strategy hsdp puts one replica on each node, but this node runs {local_world_size} of the "
            f"{world_size} processes: start the same number on every node, or give --replicate R"
        )
    replicate = config.replicate or max(1, nnodes)
    if world_size % replicate:
        raise DdpkitError(
            f"--strategy hsdp: {world_size} processes cannot form {replicate} equal replicas (one per node): "
            "start the same number of processes on every node, or give --replicate R with R dividing them"
        )
    return replicate, world_size // replicate


def hsdp_note(mesh: tuple[int, int]) -> str:
    """What a run that asked for hsdp gets, for rank 0 to print."""
    replicate, shard = mesh
    if replicate == 1:
        return (
            f"--strategy hsdp with 1 replica (one node): sharded over all {shard} processes, which is --strategy "
            "fsdp; --replicate R keeps R replicas"
        )
    return f"--strategy hsdp: {replicate} replicas x {shard} shards (gradients all-reduced across replicas)"


Rule = Callable[[StrategyConfig, int | None, bool], None]  # (config, world size or None, own_loop)
Layout = Callable[[StrategyConfig, int, int, int | None], tuple[int, int]]  # (config, world, nnodes, local)


@dataclass(frozen=True)
class StrategySpec:
    """One way of parallelising, as the CLI, the checks, the workers and the memory plan see it.

    `build`: "module:function" of the factory the workers call, `factory(rt, config, *,
    blocks, checkpoint_blocks, mesh_shape) -> Strategy`; imported only when the strategy is
    built (None: `auto`, which the workers resolve to another). `layout`: the (replicate,
    shard) mesh over the world size (None: one replica per rank, or one shard per rank when
    it `shards`; such a strategy is built without a mesh). `rules`: its own part of check(),
    after the shared rules. `memory`: what a rank holds (parallel/footprints.py); None: no column
    in the memory plan. `planned`: a column of every plan, else only when asked for."""

    name: str
    help: str  # its part of --strategy's help
    build: str | None = None
    shards: bool = False
    memory: MemoryModel | None = whole_replica
    layout: Layout | None = None
    rules: tuple[Rule, ...] = ()
    ddp_knobs: bool = True  # takes DDP's knobs (--bucket-mb, --static-graph, ...); False refuses them
    async_save: bool = False  # can write its checkpoints in the background (--async-save)
    replicas: bool = False  # takes --replicate R
    own_loop: bool = False  # offered to scripts with their own loop (rt.wrap(strategy=...))
    planned: bool = False
    label: str = ""  # its memory-plan column (default: the name in capitals)
    note: Callable[[tuple[int, int]], str | None] | None = None  # what rank 0 prints about its layout

    def mesh(
        self, config: StrategyConfig, world_size: int, nnodes: int = 1, local: int | None = None
    ) -> tuple[int, int]:
        """Its (replicate, shard) layout of `world_size` ranks on `nnodes` nodes."""
        if self.layout is not None:
            return self.layout(config, world_size, nnodes, local)
        return (1, world_size) if self.shards else (world_size, 1)

    def factory(self) -> Callable[..., Any]:
        """The function that builds its Strategy (imported now: the strategies import torch)."""
        if self.build is None:
            raise RuntimeError(f"strategy {self.name!r} builds nothing: training/auto.py resolves it to another first")
        module, _, attr = self.build.partition(":")
        return getattr(importlib.import_module(module), attr)

    @property
    def title(self) -> str:
        """Its name in the memory plan's columns."""
        return self.label or self.name.upper()

    def column(self, mesh: tuple[int, int]) -> str:
        """Its memory-plan column's head."""
        label = self.title
        if self.replicas and (mesh[0] > 1 or self.layout is hsdp_mesh):
            return f"{label} {mesh[0]}x{mesh[1]}"
        if self.shards:
            world = mesh[0] * mesh[1]
            return f"{label} x{world}" if world > 1 else f"{label} (needs 2+)"
        return label


_REGISTRY: dict[str, StrategySpec] = {}


def register(spec: StrategySpec, *, replace: bool = False) -> StrategySpec:
    """Offer `spec` under its name: to --strategy, check(), the workers and the memory plan.
    A name already taken is refused unless `replace` (a programming error: ValueError)."""
    if not spec.name or not spec.name.replace("-", "_").isidentifier():
        raise ValueError(f"a strategy's name is one word, got {spec.name!r}")
    if spec.name in _REGISTRY and not replace:
        raise ValueError(f"a strategy named {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Take a registered strategy back (tests that add one)."""
    _REGISTRY.pop(name, None)


def strategy_spec(name: str) -> StrategySpec:
    """The registered strategy `name`, or DdpkitError naming the choices."""
    return _named(name, own_loop=False)


def strategy_specs() -> tuple[StrategySpec, ...]:
    """Every registered strategy, in registration order (the built-in ones first)."""
    return tuple(_REGISTRY.values())


class _Names(Sequence[str]):
    """The registered names, read when asked: --strategy's choices take in a strategy
    registered after config.py was imported."""

    def __getitem__(self, i: Any) -> Any:
        return tuple(_REGISTRY)[i]

    def __len__(self) -> int:
        return len(_REGISTRY)

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(_REGISTRY))

    def __contains__(self, name: object) -> bool:
        return name in _REGISTRY

    def __repr__(self) -> str:
        return repr(tuple(_REGISTRY))


STRATEGIES: Sequence[str] = _Names()


def strategy_help() -> str:
    """--strategy's help: each registered strategy's line, in order."""
    return "; ".join(f"{s.name}: {s.help}" for s in _REGISTRY.values())


DDP = register(
    StrategySpec(
        "ddp",
        "a whole replica per process (fastest)",
        build="ddpkit.strategies:build_ddp",
        async_save=True,
        own_loop=True,
        planned=True,
    )
)
FSDP = register(
    StrategySpec(
        "fsdp",
        "shard parameters, gradients and optimizer state across processes (for models that do not fit)",
        build="ddpkit.strategies:build_fsdp",
        shards=True,
        memory=sharded_state,
        layout=fsdp_mesh,
        rules=(_sharded_precision, _needs_two),
        ddp_knobs=False,
        replicas=True,
        own_loop=True,
        planned=True,
        note=fsdp_note,
    )
)
HSDP = register(
    dataclasses.replace(
        FSDP,
        name="hsdp",
        help="shard within a node, replicate across nodes (only gradient shards cross nodes)",
        layout=hsdp_mesh,
        own_loop=False,
        planned=False,
        note=hsdp_note,
    )
)
AUTO = register(
    StrategySpec(
        "auto",
        "the memory plan picks the fastest that fits: the strategy, activation checkpointing, the micro-batch",
        memory=None,
    )
)
