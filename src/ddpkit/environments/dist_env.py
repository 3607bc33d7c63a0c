"""Who am I: rank, local rank, node rank, world size and master, derived from the launcher.

Nothing here touches ``torch.distributed``: this module only reads environment variables,
so it can run in the launcher, in a worker before the process group exists, and in tests.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Mapping

from . import registry
from .base import Environment


@dataclass(frozen=True)
class DistEnv:
    """The resolved place of this process in the job."""

    rank: int = 0
    local_rank: int = 0
    node_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    launcher: str = "single"  # the `name` of the environment that placed it (registry.py)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def nnodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    @property
    def environment(self) -> Environment:
        """The launcher that placed this process (what it binds, what it started)."""
        return registry.named(self.launcher)

    @property
    def outside_launcher(self) -> bool:
        """Started by an outside launcher (torchrun, srun, mpirun, a PyTorchJob) as one worker
        of its job; False: nobody placed it, and `ddpkit train` starts the workers itself."""
        return self.environment.outside_launcher

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        """Ask each environment of the registry in its order; the first that placed this
        process gives the fields (the last, Local, always does: one process)."""
        e = os.environ if environ is None else environ
        for environment in registry.ENVIRONMENTS:
            if environment.detect(e):
                return cls(**environment.fields(e), launcher=environment.name)
            environment.check_unplaced(e)
        raise AssertionError("the registry ends with an environment that always detects")

    @classmethod
    def detect_worker(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        """detect() for a process that will not start workers itself (an own loop's
        ddpkit.init()): refuses an environment that names several processes without placing
        this one (PET_NNODES/PET_NPROC_PER_NODE meant for a launcher, WORLD_SIZE without RANK)."""
        e = os.environ if environ is None else environ
        env = cls.detect(e)
        if not env.outside_launcher:
            for environment in registry.ENVIRONMENTS:
                environment.check_alone(e)
        return env
