"""Where am I in a Ray Train job: one worker of a TorchTrainer's worker group.

Ray Train starts each worker as a Ray actor (its process holds RAY_RAYLET_PID, the node's Ray
daemon), places it, makes the process group itself (env:// over MASTER_ADDR/MASTER_PORT of
worker 0) and sets torch's own variables from its train context before the train function
runs: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and NODE_RANK (ray/train/torch/config.py).
ddpkit takes that group and those ranks as they are: `ddpkit ray` (engines/ray.py) and a
user's own TorchTrainer whose train function calls ddpkit.train() or ddpkit.init() alike.
Reads variables only.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import DdpkitError
from .base import Environ, Environment, env_int

RAY_WORKER_VAR = "RAY_RAYLET_PID"  # in every process Ray starts as a worker (task or actor)
RAY_TRAIN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")  # what Ray Train adds in a TorchTrainer's workers


class Ray(Environment):
    """A worker of Ray Train (TorchTrainer): Ray placed it and made its process group."""

    name = "ray"
    starter = "Ray Train"
    launch_inside = False  # each Ray worker is one worker: a launch in each would start N jobs
    nproc_fix = "ask Ray for more workers instead (ScalingConfig(num_workers=...), `ddpkit ray --workers`)"

    def detect(self, e: Environ) -> bool:
        # torchrun started inside a Ray task sets its own variables (TORCHELASTIC_RUN_ID): torch's agent placed it
        return RAY_WORKER_VAR in e and all(v in e for v in RAY_TRAIN_VARS) and "TORCHELASTIC_RUN_ID" not in e

    def fields(self, e: Environ) -> dict[str, Any]:
        return ray_fields(e)

    def title(self, report: Mapping[str, Any]) -> str:
        return "Ray Train worker (a TorchTrainer's worker: Ray placed it and made its process group)"

    def details(self, e: Environ) -> dict[str, Any]:
        job = e.get("RAY_JOB_ID")
        return {"ray_job_id": job} if job and self.detect(e) else {}

    def report_lines(self, report: Mapping[str, Any]) -> list[str]:
        job = report.get("ray_job_id")
        return [f"  ray         job {job}"] if job else []


def ray_fields(e: Environ) -> dict[str, int | str]:
    """This worker's place in the Ray Train job (DistEnv's fields). The master is worker 0's
    address Ray made the group with; the group exists already, so none is needed to join it."""
    world, rank, local_rank = _int(e, "WORLD_SIZE"), _int(e, "RANK"), _int(e, "LOCAL_RANK")
    local_world = _int(e, "LOCAL_WORLD_SIZE", world)
    node_rank = _int(e, "NODE_RANK", rank // max(1, local_world))
    if not (0 <= rank < world and 0 <= local_rank < local_world):
        raise DdpkitError(
            f"inconsistent Ray Train environment: RANK={rank} LOCAL_RANK={local_rank} "
            f"WORLD_SIZE={world} LOCAL_WORLD_SIZE={local_world}"
        )
    return dict(
        rank=rank,
        local_rank=local_rank,
        node_rank=node_rank,
        world_size=world,
        local_world_size=local_world,
        master_addr=e.get("MASTER_ADDR") or "127.0.0.1",
        master_port=_int(e, "MASTER_PORT", 0),
    )


def _int(e: Environ, name: str, default: int | None = None) -> int:
    return env_int(
        e, name, default, unset="{name} is not set in this Ray Train worker", empty_is_unset=True, set_by="Ray Train"
    )
