"""`ddpkit plan`: a task's memory per rank under DDP, FSDP and HSDP, and which one fits."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from .. import config
from .options import option
from .parser import Command

PLAN_HELP = """Print the memory plan of a task: per-rank bytes of parameters, gradients and optimizer
state under DDP and under FSDP at --nproc processes, and which strategy fits the device memory.
With --strategy hsdp also HSDP (--replicate R, default one replica per --nnodes); with --nnodes N
(--nproc per node) the bytes each rank sends between nodes per optimizer step. Beside them the
activations one micro-batch of --batch-size keeps for backward, with and without
--activation-checkpointing (one forward of the task's first samples on this CPU), the fixed
cost of a worker (measured here) and each strategy's peak per rank; and what --strategy auto
would choose: the strategy, activation checkpointing and micro-batch (with the --accumulate
that keeps the global batch). --tp/--pp: each stage's memory per rank, the bytes sent on each dim."""


@dataclass(frozen=True)
class PlanOptions:
    json: bool = option(False, "print the plan as JSON: each strategy's peak and its parts, and auto's choice")


def cmd_plan(ns: argparse.Namespace) -> int:
    from ..launchers.elastic import start_method_for
    from ..run.plan import run_memory_plan
    from ..runtime.devices import resolve_device_type
    from .flags import config_from

    nnodes = int(str(ns.nnodes).rpartition(":")[2] or 1)  # an elastic MIN:MAX: plan for MAX
    tp, pp = ns.tp, ns.pp  # the plan without them first (the columns of DDP and FSDP), then the mesh's own
    if ns.nproc:  # a mesh the processes cannot form: one line before anything is built
        from ..parallel.dims import check_degrees

        check_degrees(ns.nproc * nnodes, tp, pp, ns.nproc)
    # the nodes count here only for the plan: no rendezvous to check; what training refuses of the mesh is said
    cfg = config_from(ns, nnodes="1", tp=1, pp=1)
    forks = start_method_for(cfg.start_method, resolve_device_type(cfg.device), clean_parent=True)
    plan = run_memory_plan(cfg, ns.nproc * nnodes if ns.nproc else ns.nproc, nnodes, ns.nproc, forks)
    mesh = None
    if tp > 1 or pp > 1:
        from ..planning.mesh import format_mesh
        from ..run.mesh_plan import mesh_plan

        world = plan.world_size
        mesh = mesh_plan(cfg, tp, pp, world, nnodes, world // nnodes, plan.process, plan.device_memory)
    if ns.json:
        print(json.dumps({**plan.as_dict(), **({"mesh": mesh.as_dict()} if mesh else {})}, indent=2), flush=True)
        return 0
    print(plan.format(ns.task, ns.strategy), flush=True)
    if mesh is not None:
        print("\n" + format_mesh(mesh, ns.task), flush=True)
    return 0


COMMAND = Command(
    cmd_plan,
    "each rank's peak memory under DDP, FSDP and HSDP, and what --strategy auto would choose",
    PLAN_HELP,
    (config.STRATEGY,),
    (
        "task",
        "nproc",
        "task_args",
        "nnodes",
        "batch_size",
        "accumulate",
        "global_batch_size",
        "cpu_allocator",
        "start_method",
        "device",
    ),
    defaults={"strategy": "auto"},
    options=PlanOptions,
    compact=True,
)
