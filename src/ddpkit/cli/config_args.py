"""`ddpkit slurm --config FILE`: the training settings file travels into the job as an
argument of `ddpkit train`, and may not say where the workers run (SLURM places them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config_file import FIELDS
from ..errors import DdpkitError

SLURM_PLACES = ("nproc", "nnodes", "node_rank", "master_addr", "master_port", "rdzv_endpoint")


def with_config_file(args: list[str], config: str | None) -> list[str]:
    """The training arguments with the config file (ddpkit slurm's --config or one after --)
    named by its absolute path: the job reads it where it starts."""
    out = list(args)
    for i, a in enumerate(out):
        if a == "--config" and i + 1 < len(out):
            out[i + 1] = str(Path(out[i + 1]).resolve())
        elif a.startswith("--config="):
            out[i] = "--config=" + str(Path(a.partition("=")[2]).resolve())
    if config:
        if any(a == "--config" or a.startswith("--config=") for a in args):
            raise DdpkitError("--config given both before and after --: keep one")
        out = ["--config", str(Path(config).resolve()), *out]
    return out


def refuse_worker_placement(settings: dict[str, Any], path: str | None) -> None:
    """Where the workers run is SLURM's, as for the flags after --: a config file may not say it."""
    for name, value in settings.items():
        if name in SLURM_PLACES and value != FIELDS[name].default:
            raise DdpkitError(
                f"{name} = {value!r} in {path} does not belong in a SLURM job: SLURM starts the "
                "workers (remove it; use --nodes / --gpus-per-node / --ntasks-per-node of `ddpkit slurm`)"
            )
