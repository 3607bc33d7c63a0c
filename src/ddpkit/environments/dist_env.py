"""Who am I: rank, local rank, node rank, world size and master, derived from the launcher.

Nothing here touches ``torch.distributed``: this module only reads environment variables,
so it can run in the launcher, in a worker before the process group exists, and in tests.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Mapping

from . import kubeflow, mpi, slurm, torchelastic


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
    # "torchrun" (torch's elastic agent, ddpkit's own included), "slurm" (srun tasks), "mpi" (mpirun: Open MPI,
    # MPICH, Intel MPI), "kubeflow" (a PyTorchJob pod that is one worker), "single"
    launcher: str = "single"

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
        """Read the environment: torchrun variables first, then SLURM, MPI, a Kubeflow pod, else one process."""
        e = os.environ if environ is None else environ
        if "LOCAL_RANK" in e and "WORLD_SIZE" in e:
            return cls(**torchelastic.torchrun_fields(e), launcher="torchrun")
        if "SLURM_JOB_ID" in e:
            if slurm.in_srun_step(e) and int(e.get("SLURM_NTASKS", "1")) > 1:
                return cls(**slurm.slurm_fields(e), launcher="slurm")  # one srun task = one worker
            slurm.check_started_by_srun(e)  # a lone task: ddpkit starts this node's workers
        if mpi.flavour(e):
            return cls(**mpi.mpi_fields(e), launcher="mpi")  # one MPI rank = one worker
        if kubeflow.is_pytorchjob_pod(e):
            return cls(**kubeflow.pod_fields(e), launcher="kubeflow")
        return cls()

    @classmethod
    def detect_worker(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        """detect() for a process that will not start workers itself (an own loop's
        ddpkit.init()): refuses an environment that names several processes without placing
        this one (PET_NNODES/PET_NPROC_PER_NODE meant for a launcher, WORLD_SIZE without RANK)."""
        e = os.environ if environ is None else environ
        env = cls.detect(e)
        if env.launcher == "single":
            kubeflow.check_nothing_missing(e)
        return env
