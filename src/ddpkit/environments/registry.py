"""The launchers ddpkit knows, in the order they are asked: the first whose detect() says yes
placed this process. torch's elastic agent comes first (torchrun inside a SLURM job or an MPI
allocation is what started this process); Local, which always says yes, comes last.

A new launcher is one file here (a subclass of base.Environment), one line in this list, and
its test (tests/unit/environments/)."""

from __future__ import annotations

from .base import Environment
from .kubeflow import Kubeflow
from .local import Local
from .mpi import Mpi
from .slurm import Slurm
from .torchelastic import TorchElastic

ENVIRONMENTS: tuple[Environment, ...] = (TorchElastic(), Slurm(), Mpi(), Kubeflow(), Local())


# Read as registry.ENVIRONMENTS at call time (DistEnv.detect, ddpkit env): one list, one place to change.


def named(name: str) -> Environment:
    """The environment whose `name` is DistEnv.launcher's value."""
    for environment in ENVIRONMENTS:
        if environment.name == name:
            return environment
    raise ValueError(f"no environment named {name!r}; known: {', '.join(e.name for e in ENVIRONMENTS)}")
