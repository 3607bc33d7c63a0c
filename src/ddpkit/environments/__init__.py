"""Where am I: this process's place in the job (rank, local rank, node, world size, master),
read from the launcher's variables (torch's elastic agent, SLURM). Reads only: no process group."""
from .dist_env import DistEnv

__all__ = ["DistEnv"]
