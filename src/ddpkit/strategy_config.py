"""The strategy's settings, typed, and its rules: what a way of parallelising refuses.

One `check` answers for RunConfig's validation (before launch), the launcher (api.py, once the
number of processes is known), the workers' make_strategy (the real world size, and what
`--strategy auto` chose) and the own-loop Session (rt.wrap's keywords). It imports no torch,
so `ddpkit --help` and the config stay instant; the strategies themselves live in strategies/.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import DdpkitError

STRATEGIES = ("ddp", "fsdp", "hsdp", "auto")
SHARDED = ("fsdp", "hsdp")  # FSDP's rules apply to both: hsdp is FSDP over a (replicate, shard) mesh
FSDP_NEEDS_TWO = (
    "--strategy fsdp shards the model across processes and needs at least 2 (--nproc 2 or more); "
    "with one process use --strategy ddp"
)


@dataclass(frozen=True)
class StrategyConfig:
    """How the model is parallelised, as the strategies read it: built from a RunConfig by
    RunConfig.strategy_config(), or from rt.wrap's keywords by the Session."""

    name: str = "ddp"  # ddp | fsdp | hsdp | auto (the memory plan picks ddp or fsdp in the workers)
    precision: str = "fp32"
    device_memory: int | None = None  # bytes per device for the memory plan (None: detected)
    async_save: bool = False  # background checkpoints: one-file (DDP) checkpoints only
    activation_checkpointing: bool = False  # recompute each block's activations in backward (activation.py)
    # DDP's knobs (strategies/ddp_knobs.py); FSDP reduce-scatters by itself and refuses them
    grad_sync: str = "auto"
    grad_compression: str = "none"
    bucket_mb: float | None = None
    static_graph: bool = False
    fused_optimizer: str = "off"
    compile: bool = False
    ddp_options: dict[str, Any] = field(default_factory=dict)  # DistributedDataParallel keywords (rt.wrap's)
    replicate: int | None = None  # hsdp's replicas (None: one per node); the shards are world_size / replicate


def check(
    config: StrategyConfig,
    world_size: int | None = None,
    *,
    mesh_shape: tuple[int, int] | None = None,
    own_loop: bool = False,
) -> None:
    """Refuse what `config` cannot do with `world_size` processes (None: not known yet).

    `mesh_shape`: FSDP's (replicate, shard) device mesh, whose product must be the world size.
    `own_loop`: spell the messages as rt.wrap's keywords instead of the CLI's flags."""
    if config.name not in (("ddp", "fsdp") if own_loop else STRATEGIES):
        raise DdpkitError(
            f"rt.wrap(strategy=...) must be 'ddp' or 'fsdp', got {config.name!r}"
            if own_loop
            else f"--strategy must be one of {', '.join(STRATEGIES)}, got {config.name!r}"
        )
    _check_replicate(config, world_size)
    if config.name in SHARDED:
        ddp_only = _ddp_only(config, own_loop)
        if ddp_only and own_loop:
            raise DdpkitError(
                f"rt.wrap(strategy='fsdp'): {', '.join(ddp_only)} are DDP options; drop them or use strategy='ddp'"
            )
        if ddp_only:
            raise DdpkitError(
                f"{', '.join(ddp_only)}: DDP options, not available with --strategy {config.name}; drop them or use "
                "--strategy ddp"
            )
    if config.activation_checkpointing and config.compile:
        raise DdpkitError(
            "--activation-checkpointing with --compile: ddpkit compiles the whole DDP model, and the compiled "
            "graph does not recompute checkpointed blocks as they ran (torch raises a CheckpointError); drop one "
            "of the two"
        )
    if config.async_save and config.name != "ddp":
        raise DdpkitError(
            "--async-save writes DDP's one-file checkpoints in the background; FSDP's sharded checkpoints are "
            "written by every rank together: drop --async-save with --strategy "
            + ("hsdp" if config.name == "hsdp" else "fsdp/auto")
        )
    if config.name not in SHARDED:
        return
    if config.precision == "fp16":
        raise DdpkitError(
            "precision='fp16' needs a gradient scaler, which ddpkit offers under DDP only; use 'bf16' with FSDP"
            if own_loop
            else "--precision fp16 needs a gradient scaler, which ddpkit offers under DDP only; "
            f"use --precision bf16 with --strategy {config.name}"
        )
    if world_size is not None and world_size < 2:
        raise DdpkitError(
            FSDP_NEEDS_TWO.replace("--nproc 2 or more", "start the script with 2 or more processes").replace(
                "--strategy ddp", "strategy='ddp'"
            )
            if own_loop
            else FSDP_NEEDS_TWO.replace("--strategy fsdp", f"--strategy {config.name}")
        )
    if mesh_shape is not None:
        _check_mesh(mesh_shape, world_size)


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
            ("--compile", config.compile),
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


def _check_replicate(config: StrategyConfig, world_size: int | None) -> None:
    """--replicate lays out hsdp's replicas: a positive divisor of the number of processes."""
    r = config.replicate
    if r is None:
        return
    if config.name != "hsdp":
        raise DdpkitError(
            f"--replicate {r} sets the replicas of --strategy hsdp (shard within a replica, all-reduce across "
            f"replicas); use --strategy hsdp --replicate {r}, or drop --replicate"
        )
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise DdpkitError(f"--replicate must be a positive number of replicas, got {r!r}")
    if world_size is not None and world_size % r:
        raise DdpkitError(
            f"--replicate {r} does not divide the {world_size} processes into equal replicas: choose a divisor "
            f"of {world_size} (each replica holds world size / replicate shards)"
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
