"""The job, as every engine reads it: a config file's `[launch]` table (nodes, GPUs per node,
time, partition / image / cloud, the run directory). The training settings say WHAT runs; this
table says WHERE and FOR HOW LONG, and `ddpkit slurm`, `k8s`, `ray` and `sky` each read it (and
their own flags, which win over it: engines/job.py). `ddpkit train` ignores the table, so one
file describes the whole job."""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass
from typing import Any

from ..errors import DdpkitError
from .values import parse_memory

TABLE = "launch"
_TIME = re.compile(r"^(?:(\d+)-)?(\d{1,2})(?::(\d{2}))?(?::(\d{2}))?$")


@dataclass(frozen=True)
class LaunchTable:
    """Every key of `[launch]`; None: not given (the engine's default applies). The help of
    each key is its metadata's, shown in docs/config.md."""

    nodes: int | None = dataclasses.field(default=None, metadata={"help": "machines (nodes) the job spans"})
    gpus_per_node: int | None = dataclasses.field(default=None, metadata={"help": "GPUs per node (0: CPU nodes)"})
    workers_per_node: int | None = dataclasses.field(
        default=None, metadata={"help": "worker processes per node on CPU nodes (default: GPUs per node, or 1)"}
    )
    cpus_per_worker: int | None = dataclasses.field(default=None, metadata={"help": "CPU cores per worker"})
    memory: str | None = dataclasses.field(default=None, metadata={"help": "host memory per node, e.g. 64GiB"})
    time: str | None = dataclasses.field(
        default=None, metadata={"help": "the job's time limit: MM, HH:MM:SS or D-HH:MM:SS"}
    )
    partition: str | None = dataclasses.field(default=None, metadata={"help": "SLURM partition"})
    account: str | None = dataclasses.field(default=None, metadata={"help": "SLURM account to charge"})
    image: str | None = dataclasses.field(default=None, metadata={"help": "container image (Kubernetes, SkyPilot)"})
    cloud: str | None = dataclasses.field(default=None, metadata={"help": "SkyPilot cloud, e.g. aws, gcp, kubernetes"})
    accelerator: str | None = dataclasses.field(
        default=None, metadata={"help": "GPU type, e.g. H100 (SkyPilot; Kubernetes node selector)"}
    )
    namespace: str | None = dataclasses.field(default=None, metadata={"help": "Kubernetes namespace"})
    volume: str | None = dataclasses.field(
        default=None, metadata={"help": "shared volume for the run directory (Kubernetes PVC, SkyPilot volume)"}
    )
    address: str | None = dataclasses.field(default=None, metadata={"help": "Ray cluster address"})
    run_dir: str | None = dataclasses.field(
        default=None, metadata={"help": "the run directory, on storage every node shares"}
    )
    shared_run_dir: bool | None = dataclasses.field(
        default=None,
        metadata={"help": "the run directory IS shared though its file system looks local (e.g. one machine)"},
    )
    exclude_slow: bool | None = dataclasses.field(
        default=None, metadata={"help": "SLURM: leave out, at the next requeue, a node named slow twice in a row"}
    )
    job_name: str | None = dataclasses.field(default=None, metadata={"help": "the job's name"})

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "workers_per_node", "cpus_per_worker"):
            value = getattr(self, name)
            least = 0 if name == "gpus_per_node" else 1
            if value is not None and value < least:
                raise DdpkitError(f"[launch] {name} must be at least {least}, got {value}")
        if self.time is not None:
            time_limit_s(self.time)
        if self.memory is not None:
            parse_memory(self.memory, "[launch] memory")

    @property
    def time_limit_s(self) -> int | None:
        return None if self.time is None else time_limit_s(self.time)


KEYS = {f.name: f for f in dataclasses.fields(LaunchTable)}
_TYPES = {"int | None": int, "str | None": str, "bool | None": bool}


def time_limit_s(text: str) -> int:
    """Seconds of a time limit written as SLURM reads one: MM, MM:SS, HH:MM:SS, D-HH,
    D-HH:MM or D-HH:MM:SS."""
    m = _TIME.match(str(text).strip())
    if not m:
        raise DdpkitError(f"time {text!r} is not a time limit: MM, HH:MM:SS or D-HH:MM:SS (e.g. 04:00:00)")
    days, first, second, third = m.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        h, mi, s = int(first), int(second or 0), int(third or 0)
        return ((int(days) * 24 + h) * 60 + mi) * 60 + s
    if second is None:  # MM
        return int(first) * 60
    if third is None:  # MM:SS
        return int(first) * 60 + int(second)
    return (int(first) * 60 + int(second)) * 60 + int(third)  # HH:MM:SS


def launch_table(data: Any, where: str) -> LaunchTable:
    """The [launch] table of a parsed config file, each key checked (`where` names the file)."""
    if data is None:
        return LaunchTable()
    if not isinstance(data, dict):
        raise DdpkitError(f"{where}: [launch] must be a table of KEY = VALUE, got {type(data).__name__}")
    values: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in KEYS:
            near = difflib.get_close_matches(name, list(KEYS), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else f" (the keys: {', '.join(KEYS)})"
            raise DdpkitError(f"{where}: unknown key launch.{key}{hint}")
        expected = _TYPES[str(KEYS[name].type)]
        if expected is str and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # memory = 64 (bytes), time = 30 (minutes)
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            noun = {int: "an integer", str: "text", bool: "true or false"}[expected]
            raise DdpkitError(f"{where}: launch.{key} must be {noun}, got {value!r}")
        values[name] = value
    try:
        return LaunchTable(**values)
    except DdpkitError as e:
        raise DdpkitError(f"{where}: {e}") from None
