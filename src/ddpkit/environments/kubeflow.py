"""Where am I in a Kubeflow job. Two shapes, both documented by Kubeflow:

- PyTorchJob (training-operator) with one process per pod: every pod gets MASTER_ADDR,
  MASTER_PORT, WORLD_SIZE and RANK (its index), no LOCAL_RANK: one pod is one ddpkit worker.
- torchrun's own variables, PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR,
  PET_MASTER_PORT (PyTorchJob with nprocPerNode, Kubeflow Trainer's torch runtime): they are
  meant for a launcher in the pod (torchrun reads every flag from PET_<FLAG>); `ddpkit launch`
  and `ddpkit train` read them the same way (`Kubeflow.launcher_defaults`).

A script that is started alone (`python train.py`) where these name a world of several
processes would otherwise train N independent copies; `check_nothing_missing` refuses that.
Reads variables only.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import DdpkitError
from ..util.jobtoken import has_job_token
from .base import DEFAULT_PORT, Environ, Environment

# RunConfig field <- torchrun's flag (PET_<FLAG>), as torchrun's argparse `env` action reads them.
PET_FIELDS = {
    "nnodes": "NNODES",
    "nproc": "NPROC_PER_NODE",
    "node_rank": "NODE_RANK",
    "master_addr": "MASTER_ADDR",
    "master_port": "MASTER_PORT",
    "rdzv_endpoint": "RDZV_ENDPOINT",
    "rdzv_id": "RDZV_ID",
    "rdzv_backend": "RDZV_BACKEND",
    "rdzv_conf": "RDZV_CONF",
    "max_restarts": "MAX_RESTARTS",
    "monitor_interval": "MONITOR_INTERVAL",
    "start_method": "START_METHOD",
    "log_dir": "LOG_DIR",
    "redirects": "REDIRECTS",
    "tee": "TEE",
    "local_ranks_filter": "LOCAL_RANKS_FILTER",
    "local_addr": "LOCAL_ADDR",
}


class Kubeflow(Environment):
    """A PyTorchJob pod that is itself one worker (RANK and WORLD_SIZE, no LOCAL_RANK)."""

    name = "kubeflow"
    starter = "the PyTorchJob"
    launch_inside = False

    def detect(self, e: Environ) -> bool:
        return is_pytorchjob_pod(e)

    def fields(self, e: Environ) -> dict[str, Any]:
        return pod_fields(e)

    def check_alone(self, e: Environ) -> None:
        check_nothing_missing(e)

    def feeds_launcher(self, e: Environ) -> bool:
        return any(k.startswith("PET_") for k in e)

    def launcher_defaults(self, e: Environ) -> dict[str, str]:
        """The PET_* variables set here, as torchrun reads them: the defaults of its flags. With a
        job token (a Kubernetes Secret's DDPKIT_JOB_TOKEN), the operator's master is met through a
        c10d rendezvous on it instead of the static one: only c10d's store is sealed with the token
        (the pod whose address it is hosts it; node ranks are assigned at the rendezvous)."""
        found = {name: e[f"PET_{flag}"] for name, flag in PET_FIELDS.items() if e.get(f"PET_{flag}")}
        if "master_addr" in found and "rdzv_endpoint" not in found and has_job_token(e):
            found["rdzv_endpoint"] = f"{found.pop('master_addr')}:{found.pop('master_port', DEFAULT_PORT)}"
            found.pop("node_rank", None)
        return found

    def title(self, report: Mapping[str, Any]) -> str:
        return "Kubeflow PyTorchJob pod (RANK/WORLD_SIZE: one pod, one worker)"

    def details(self, e: Environ) -> dict[str, Any]:
        """Kubeflow's torchrun variables: what ddpkit launch / train will read as their flags."""
        pet = {k: e[k] for k in sorted(e) if k.startswith("PET_")}
        return {"pet": pet} if pet else {}

    def report_lines(self, report: Mapping[str, Any]) -> list[str]:
        if not report.get("pet"):
            return []
        return [
            "  kubeflow    "
            + " ".join(f"{k}={v}" for k, v in report["pet"].items())
            + " (read by ddpkit launch / train as torchrun's flags)"
        ]


def is_pytorchjob_pod(e: Environ) -> bool:
    """A PyTorchJob pod that is itself one worker: RANK and WORLD_SIZE, no LOCAL_RANK, and no
    PET_NPROC_PER_NODE above 1 (that pod is meant to start several processes)."""
    return "RANK" in e and "WORLD_SIZE" in e and "LOCAL_RANK" not in e and _nproc(e) <= 1


def pod_fields(e: Environ) -> dict[str, int | str]:
    """This pod's place in the job (DistEnv's fields): one pod, one process."""
    try:
        rank, world = int(e["RANK"]), int(e["WORLD_SIZE"])
    except ValueError:
        raise DdpkitError(f"RANK={e['RANK']!r} / WORLD_SIZE={e['WORLD_SIZE']!r} are not integers") from None
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not e.get(v)] if world > 1 else []
    if missing:
        raise DdpkitError(
            f"RANK and WORLD_SIZE={world} are set but {', '.join(missing)} is not: the job's other "
            "processes cannot be reached; set both (a PyTorchJob sets them in every pod)"
        )
    if not 0 <= rank < world:
        raise DdpkitError(f"inconsistent environment: RANK={rank} WORLD_SIZE={world}")
    return dict(
        rank=rank,
        local_rank=0,
        node_rank=rank,
        world_size=world,
        local_world_size=1,
        master_addr=e.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(e.get("MASTER_PORT", "0") or 0),
    )


def check_nothing_missing(e: Environ) -> None:
    """This process found no launcher that placed it; refuse when the environment still names
    a world of several processes (else it would train alone, one of N silent copies)."""
    nnodes = e.get("PET_NNODES", "1").split(":")[-1]
    world = e.get("WORLD_SIZE", "1")
    if _nproc(e) > 1 or (nnodes.isdigit() and int(nnodes) > 1):
        raise DdpkitError(
            f"this pod is meant to run {e.get('PET_NNODES', '1')} node(s) x {e.get('PET_NPROC_PER_NODE', '1')} "
            "process(es) (PET_NNODES / PET_NPROC_PER_NODE), but the script was started alone: start it with "
            "`ddpkit launch SCRIPT.py` (or torchrun), which reads the PET_* variables"
        )
    if world.isdigit() and int(world) > 1:
        raise DdpkitError(
            f"WORLD_SIZE={world} is set but not RANK: this process cannot know its place in the job; "
            "start it with `ddpkit launch` / torchrun, or set RANK, MASTER_ADDR and MASTER_PORT"
        )


def _nproc(e: Environ) -> int:
    raw = e.get("PET_NPROC_PER_NODE", "1")
    return int(raw) if raw.isdigit() else 2  # 'auto', 'gpu', 'cpu': a launcher in the pod decides
