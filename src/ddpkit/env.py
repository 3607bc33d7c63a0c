"""Who am I: rank, local rank, node rank, world size and master, derived from the launcher.

Nothing here touches ``torch.distributed``: this module only reads environment variables,
so it can run in the launcher, in a worker before the process group exists, and in tests.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Mapping

from .errors import DdpkitError

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


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
    def detect(cls, environ: Mapping[str, str] | None = None) -> "DistEnv":
        """Read the environment: torchrun variables first, then SLURM, else one process."""
        e = os.environ if environ is None else environ
        if "LOCAL_RANK" in e and "WORLD_SIZE" in e:
            return cls._from_torchrun(e)
        if "SLURM_JOB_ID" in e:
            from .launch import slurm_env  # only when SLURM is really there

            if slurm_env.in_srun_step(e) and int(e.get("SLURM_NTASKS", "1")) > 1:
                return slurm_env.slurm_dist_env(e)  # one srun task = one worker
            slurm_env.check_started_by_srun(e)  # a lone task: ddpkit starts this node's workers
        return cls()

    @classmethod
    def _from_torchrun(cls, e: Mapping[str, str]) -> "DistEnv":
        missing = [v for v in TORCHRUN_VARS if v not in e]
        if missing:
            raise DdpkitError(
                f"incomplete launcher environment: {', '.join(missing)} not set "
                "(start the script with `ddpkit launch` or `torchrun`, which set all of them)"
            )
        world = _int(e, "WORLD_SIZE")
        local_world = _int(e, "LOCAL_WORLD_SIZE", default=world)
        rank = _int(e, "RANK")
        local_rank = _int(e, "LOCAL_RANK")
        # GROUP_RANK is the node's index as the elastic agent assigned it (rendezvous order).
        node_rank = _int(e, "GROUP_RANK", default=rank // max(1, local_world))
        if not (0 <= rank < world and 0 <= local_rank < local_world):
            raise DdpkitError(
                f"inconsistent launcher environment: RANK={rank} LOCAL_RANK={local_rank} "
                f"WORLD_SIZE={world} LOCAL_WORLD_SIZE={local_world}"
            )
        return cls(
            rank=rank,
            local_rank=local_rank,
            node_rank=node_rank,
            world_size=world,
            local_world_size=local_world,
            master_addr=e["MASTER_ADDR"],
            master_port=_int(e, "MASTER_PORT"),
            launcher="torchrun",
        )


def _int(e: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = e.get(name)
    if raw is None:
        if default is None:
            raise DdpkitError(f"{name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise DdpkitError(f"{name}={raw!r} is not an integer") from None
