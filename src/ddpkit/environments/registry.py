"""The launchers ddpkit knows, in the order they are asked: the first whose detect() says yes
placed this process. Ray Train first (its workers carry torch's variables too, set by Ray, not by
torch's agent), then torch's elastic agent (torchrun inside a SLURM job or an MPI allocation is what
started this process); Local, which always says yes, comes last.

A new launcher is one file here (a subclass of base.Environment), one line in this list, and
its test (tests/unit/environments/)."""

from __future__ import annotations

import os

from .base import Environ, Environment, StopRequest
from .kubeflow import Kubeflow
from .local import Local
from .mpi import Mpi
from .ray import Ray
from .skypilot import SkyPilot
from .slurm import Slurm
from .torchelastic import TorchElastic

ENVIRONMENTS: tuple[Environment, ...] = (Ray(), TorchElastic(), Slurm(), Mpi(), Kubeflow(), SkyPilot(), Local())


# Read as registry.ENVIRONMENTS at call time (DistEnv.detect, ddpkit env): one list, one place to change.


def named(name: str) -> Environment:
    """The environment whose `name` is DistEnv.launcher's value."""
    for environment in ENVIRONMENTS:
        if environment.name == name:
            return environment
    raise ValueError(f"no environment named {name!r}; known: {', '.join(e.name for e in ENVIRONMENTS)}")


def launcher_defaults(environ: Environ | None = None) -> dict[str, str]:
    """The defaults of the node flags of `ddpkit train` / `launch` that the launchers whose
    variables are here supply (Environment.launcher_defaults); the first in the list wins a field."""
    e = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for environment in ENVIRONMENTS:
        for name, value in environment.launcher_defaults(e).items():
            out.setdefault(name, value)
    return out


def request_requeue(stop: StopRequest, environ: Environ | None = None) -> None:
    """--requeue, on rank 0, after the checkpoint of a stop by signal: the scheduler of the job this
    process runs in puts it back in its queue (Environment.requeue; SLURM's, whoever placed the
    process: ddpkit's own workers inside an srun task too). In no scheduler's job: said, nothing done."""
    e = os.environ if environ is None else environ
    if not any(environment.requeue(stop, e) for environment in ENVIRONMENTS):
        print("ddpkit: --requeue: not inside a SLURM job; stopping after the checkpoint instead", flush=True)
