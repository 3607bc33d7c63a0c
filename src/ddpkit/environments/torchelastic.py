"""Where am I under torch's elastic agent (torchrun, `ddpkit launch`, `ddpkit train`'s own workers).

Reads variables only: nothing here touches torch.distributed.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import DdpkitError
from .base import Environ, Environment, env_int

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class TorchElastic(Environment):
    """One worker of torch's elastic agent: torchrun, `ddpkit launch`, `ddpkit train`'s own workers."""

    name = "torchrun"
    starter = "torchrun"

    def detect(self, e: Environ) -> bool:
        return "LOCAL_RANK" in e and "WORLD_SIZE" in e

    def fields(self, e: Environ) -> dict[str, Any]:
        return torchrun_fields(e)

    def title(self, report: Mapping[str, Any]) -> str:
        return "torchrun (torch's elastic agent: torchrun, ddpkit launch)"


def torchrun_fields(e: Environ) -> dict[str, int | str]:
    """This worker's place in the job (DistEnv's fields) from the variables torch's elastic agent sets."""
    missing = [v for v in TORCHRUN_VARS if v not in e]
    if missing:
        raise DdpkitError(
            f"incomplete launcher environment: {', '.join(missing)} not set "
            "(start the script with `ddpkit launch` or `torchrun`, which set all of them)"
        )
    world = env_int(e, "WORLD_SIZE")
    local_world = env_int(e, "LOCAL_WORLD_SIZE", default=world)
    rank = env_int(e, "RANK")
    local_rank = env_int(e, "LOCAL_RANK")
    # GROUP_RANK is the node's index as the elastic agent assigned it (rendezvous order).
    node_rank = env_int(e, "GROUP_RANK", default=rank // max(1, local_world))
    if not (0 <= rank < world and 0 <= local_rank < local_world):
        raise DdpkitError(
            f"inconsistent launcher environment: RANK={rank} LOCAL_RANK={local_rank} "
            f"WORLD_SIZE={world} LOCAL_WORLD_SIZE={local_world}"
        )
    return dict(
        rank=rank,
        local_rank=local_rank,
        node_rank=node_rank,
        world_size=world,
        local_world_size=local_world,
        master_addr=e["MASTER_ADDR"],
        master_port=env_int(e, "MASTER_PORT"),
    )
