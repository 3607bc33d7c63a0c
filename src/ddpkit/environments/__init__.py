"""Where am I: this process's place in the job (rank, local rank, node, world size, master),
read from the launcher's variables (torch's elastic agent, SLURM, MPI, Kubeflow). Reads only:
no process group (but for a scheduler's requeue at a run's end, registry.request_requeue).
One file per launcher, asked in the order of registry.ENVIRONMENTS."""

from .base import Environment
from .dist_env import DistEnv
from .registry import ENVIRONMENTS

__all__ = ["ENVIRONMENTS", "DistEnv", "Environment"]
