"""What every way of being started has to answer, so that `DistEnv.detect`, `ddpkit env` and
the API ask the one ordered list (registry.py) and never a launcher's name.

An environment is one kind of launcher: torch's elastic agent, SLURM's srun, mpirun, a
Kubeflow PyTorchJob, or none (ddpkit starts the workers). Each reads environment variables
only: nothing here touches torch.distributed or another machine. One act is a scheduler's:
requeue() puts the job back in its queue at the end of a run (SLURM's; the others have none).
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

from ..errors import DdpkitError

DEFAULT_PORT = "29500"  # torchrun's --master-port default: where a node without a port of its own meets

Environ = Mapping[str, str]


def env_int(
    e: Environ,
    name: str,
    default: int | None = None,
    *,
    unset: str = "{name} is not set",
    empty_is_unset: bool = False,
    set_by: str = "",
) -> int:
    """The integer a launcher's variable `name` holds; `default` where it is unset (an empty value
    counts as unset with `empty_is_unset`), else a DdpkitError: `unset` (its text, with {name}),
    or that the value is no integer (`set_by`: who set it, said after)."""
    raw = e.get(name)
    if raw is None or (empty_is_unset and raw == ""):
        if default is None:
            raise DdpkitError(unset.format(name=name))
        return default
    try:
        return int(raw)
    except ValueError:
        raise DdpkitError(f"{name}={raw!r} is not an integer" + (f" (set by {set_by})" if set_by else "")) from None


class StopRequest(Protocol):
    """What a requeue reads of the run's stop by signal (training/signals.py's StopRequest)."""

    received: str | None  # the signal's name, e.g. "SIGUSR2"

    @property
    def wants_requeue(self) -> bool:
        """Not stopped by a signal that ends the job (SIGTERM, SIGINT)."""
        ...


class Environment:
    """One launcher's view of this process. Subclasses override what differs; the defaults
    are those of a launcher that starts one process per worker and binds no GPU itself."""

    name = ""  # DistEnv.launcher: "torchrun", "slurm", "mpi", "kubeflow", "single"
    starter = ""  # who started the processes, as messages name it: "torchrun", "srun", "mpirun"
    # True: an outside launcher started every worker, this process is one of them; False:
    # nobody did, ddpkit starts this node's workers itself
    outside_launcher = True
    # `ddpkit launch` inside each process: False where every process is already one worker
    # of one job, so a launch in each would start that many independent jobs
    launch_inside = True
    nproc_fix = "set --nproc-per-node of torchrun instead"  # how to get more processes per node

    # -- where am I ---------------------------------------------------------------------------
    def detect(self, e: Environ) -> bool:
        """Did this launcher place this process (its rank is in the variables)?"""
        raise NotImplementedError

    def fields(self, e: Environ) -> dict[str, Any]:
        """DistEnv's fields (rank, local_rank, node_rank, world_size, local_world_size,
        master_addr, master_port) once detect() said yes; a DdpkitError names what is missing."""
        raise NotImplementedError

    def present(self, e: Environ) -> bool:
        """Are this launcher's variables here at all (`ddpkit env` names it even when it
        placed nobody, e.g. SLURM's batch script)?"""
        return self.detect(e)

    def check_unplaced(self, e: Environ) -> None:
        """Its variables may be here but it did not place this process, so ddpkit would start
        the workers: raise where that cannot work (SLURM's batch script on several nodes)."""

    def check_alone(self, e: Environ) -> None:
        """Nobody placed this process and it will start no workers (an own loop's
        ddpkit.init()): raise where the variables still name a world of several processes."""

    def feeds_launcher(self, e: Environ) -> bool:
        """Are some variables flags for a launcher started here (Kubeflow's PET_*)? Then this
        process is that launcher, resolved as `ddpkit train` would, not as a lone script."""
        return False

    def launcher_defaults(self, e: Environ) -> dict[str, str]:
        """{RunConfig field: text}: what this launcher's variables say the node flags of
        `ddpkit train` / `ddpkit launch` are, where it starts those commands rather than the
        workers (Kubeflow's PET_*, SkyPilot's nodes); a flag given on the command line wins."""
        return {}

    # -- what it means for the run ------------------------------------------------------------
    def gpu_index(self, local_rank: int, gpus: int) -> int | None:
        """The GPU (of the `gpus` this process sees) that this local rank uses; None: none is left."""
        return local_rank if local_rank < gpus else None

    def check_devices(self, local_world_size: int, device_type: str) -> None:
        """Refuse, before anything starts, a node that runs more workers than it can serve."""

    def job_id(self, e: Environ) -> str | None:
        """The scheduler's id of this job, which names the default run directory (a requeued
        job then continues in the same one); None: the launcher has none."""
        return None

    def requeue(self, stop: StopRequest, e: Environ) -> bool:
        """--requeue, on rank 0, after the checkpoint of a stop by `stop`'s signal: put this job
        back in the scheduler's queue, to resume from it (--auto-resume). False: this process is
        in no job of this environment's scheduler, nothing was done (the default: no queue)."""
        return False

    # -- what `ddpkit env` shows --------------------------------------------------------------
    def title(self, report: Mapping[str, Any]) -> str:
        """The `detected` line, given the launcher section of the report."""
        return self.name

    def details(self, e: Environ) -> dict[str, Any]:
        """Plain data for the launcher section of the report, whichever launcher was found
        (SLURM's allocation under torchrun is still worth showing); {} when nothing applies."""
        return {}

    def report_lines(self, report: Mapping[str, Any]) -> list[str]:
        """Text lines for what details() added."""
        return []

    def allocated_nodes(self, e: Environ) -> int | None:
        """Nodes the scheduler gave this job, whether or not it placed this process."""
        return None

    def master_of(self, report: Mapping[str, Any]) -> tuple[str, str] | None:
        """(master address, where it comes from) when MASTER_ADDR is not set; None: not known here."""
        return None

    def warnings(self, report: Mapping[str, Any], cores: int) -> list[str]:
        """Traps of this launcher's set-up, from the launcher section of the report."""
        return []
