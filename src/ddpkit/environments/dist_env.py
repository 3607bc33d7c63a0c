"""Who am I: rank, local rank, node rank, world size and master, derived from the launcher.

Nothing here touches ``torch.distributed``: this module only reads environment variables,
so it can run in the launcher, in a worker before the process group exists, and in tests.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Mapping

from . import slurm, torchelastic


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
    launcher: str = "single"  # "torchrun" (torch's elastic agent, ddpkit's own included), "slurm" (srun tasks), "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def nnodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        """Read the environment: torchrun variables first, then SLURM, else one process."""
        e = os.environ if environ is None else environ
        if "LOCAL_RANK" in e and "WORLD_SIZE" in e:
            return cls(**torchelastic.torchrun_fields(e), launcher="torchrun")
        if "SLURM_JOB_ID" in e:
            if slurm.in_srun_step(e) and int(e.get("SLURM_NTASKS", "1")) > 1:
                return cls(**slurm.slurm_fields(e), launcher="slurm")  # one srun task = one worker
            slurm.check_started_by_srun(e)  # a lone task: ddpkit starts this node's workers
        return cls()
