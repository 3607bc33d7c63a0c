"""Where am I when mpirun / mpiexec started this process: Open MPI (OMPI_COMM_WORLD_*), MPICH
and Intel MPI's Hydra (PMI_RANK / PMI_SIZE, MPI_LOCALRANKID / MPI_LOCALNRANKS), or PMIx
(PMIX_RANK, with the local rank from Open MPI's variables). One MPI rank is one ddpkit worker.

MPI gives ranks, not a TCP rendezvous: the process group needs MASTER_ADDR and MASTER_PORT.
On one node the master is this host (127.0.0.1); across nodes the job must name it
(`mpirun -x MASTER_ADDR=<rank 0's host>`), else ddpkit refuses rather than guess. The port is
MASTER_PORT when set, else derived from the MPI job's id (the same on every rank, different
for two jobs on one node), as SLURM's is. Reads variables only.
"""

from __future__ import annotations

import re
import zlib
from typing import Any, Mapping

from ..errors import DdpkitError
from .base import Environ, Environment, env_int

FLAVOURS = {  # name: (rank, size, local rank, local size)
    "openmpi": (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
}


class Mpi(Environment):
    """One rank of mpirun / mpiexec is one worker."""

    name = "mpi"
    starter = "mpirun"
    launch_inside = False

    def detect(self, e: Environ) -> bool:
        return flavour(e) is not None

    def fields(self, e: Environ) -> dict[str, Any]:
        return mpi_fields(e)

    def title(self, report: Mapping[str, Any]) -> str:
        return f"MPI ({report.get('mpi')}: mpirun/mpiexec, one rank per worker)"

    def details(self, e: Environ) -> dict[str, Any]:
        name = flavour(e)
        return {"mpi": name} if name else {}


def flavour(e: Environ) -> str | None:
    """Which MPI started this process ('openmpi', 'mpich'), or None."""
    for name, (rank, size, _, _) in FLAVOURS.items():
        if rank in e and size in e:
            return name
    return None


def port_for_job(e: Environ) -> int | None:
    """A port every rank of this MPI job derives alike: from Open MPI's job id
    (OMPI_MCA_orte_hnp_uri "JOBID.0;tcp://...", OMPI_MCA_ess_base_jobid, PMIX_NAMESPACE) or
    Hydra's PMI_KVSNAME / PMI_PORT; None when the job names none of them."""
    for var in ("OMPI_MCA_orte_hnp_uri", "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "PMI_KVSNAME", "PMI_PORT"):
        value = e.get(var)
        if value:
            job = re.split(r"[;.]", value)[0] if var == "OMPI_MCA_orte_hnp_uri" else value
            return 15000 + zlib.crc32(job.encode()) % 20000
    return None


def mpi_fields(e: Environ) -> dict[str, int | str]:
    """This MPI rank's place in the job (DistEnv's fields)."""
    name = flavour(e)
    assert name is not None
    rank_var, size_var, local_var, local_size_var = FLAVOURS[name]
    rank, world = _int(e, rank_var), _int(e, size_var)
    local_rank = _int(e, local_var, 0 if world == 1 else None)
    local_world = _int(e, local_size_var, 1 if world == 1 else None)
    if not (0 <= rank < world and 0 <= local_rank < local_world <= world):
        raise DdpkitError(
            f"inconsistent MPI environment: {rank_var}={rank} {size_var}={world} "
            f"{local_var}={local_rank} {local_size_var}={local_world}"
        )
    nodes = -(-world // local_world)
    addr = e.get("MASTER_ADDR")
    if not addr:
        if nodes > 1:
            raise DdpkitError(
                f"started by mpirun on {nodes} nodes, but MASTER_ADDR is not set: name rank 0's host for "
                "the process group, e.g. `mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT=29500 ...` "
                "(with rank 0 on that host)"
            )
        addr = "127.0.0.1"  # every rank is on this node
    port = int(e["MASTER_PORT"]) if e.get("MASTER_PORT") else port_for_job(e)
    if port is None:
        raise DdpkitError(
            "started by mpirun, but neither MASTER_PORT is set nor an MPI job id to derive a port from: "
            "pass one, e.g. `mpirun -x MASTER_PORT=29500 ...`"
        )
    return dict(
        rank=rank,
        local_rank=local_rank,
        node_rank=rank // local_world,
        world_size=world,
        local_world_size=local_world,
        master_addr=addr,
        master_port=port,
    )


def _int(e: Environ, name: str, default: int | None = None) -> int:
    return env_int(
        e,
        name,
        default,
        unset="started by mpirun, but {name} is not set (an MPI that ddpkit does not know?); "
        "start the script with `ddpkit launch` or torchrun instead",
    )
