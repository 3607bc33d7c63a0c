"""Which device, backend and thread count this process uses: decided before the process
group exists, so the launcher can refuse a bad request before any worker starts."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..environments import DistEnv
from ..errors import DdpkitError
from ..util.envvars import SHARE_GPU_VAR


def cuda_device_count() -> int:
    """GPUs visible to this process, asked through NVML so the CUDA driver is not
    initialised (a parent that forks workers must not have touched CUDA)."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    if not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


def resolve_device_type(requested: str) -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'. 'cuda' without one is an error."""
    has_cuda = cuda_device_count() > 0
    if requested == "cuda" and not has_cuda:
        raise DdpkitError("--device cuda was asked for but no CUDA GPU is visible; use --device cpu (or auto)")
    if requested == "auto":
        return "cuda" if has_cuda else "cpu"
    return requested


def resolve_backend(requested: str, device_type: str, shared: bool = False) -> str:
    """NCCL for GPUs, gloo for CPUs. NCCL without a GPU is refused, not attempted. `shared`:
    ranks share GPUs (DDPKIT_SHARE_GPU=1), which NCCL refuses ("duplicate GPU"): gloo."""
    if shared:
        if requested == "nccl":
            raise DdpkitError(
                f"--backend nccl with {SHARE_GPU_VAR}=1: NCCL refuses two ranks on one GPU; drop --backend "
                "(auto takes gloo when ranks share a GPU), or start at most one process per GPU"
            )
        return "gloo"
    if requested == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if requested == "nccl" and device_type != "cuda":
        raise DdpkitError("--backend nccl needs a CUDA GPU and none is in use; use --backend gloo (or auto)")
    return requested


def share_gpu_opted(environ: Mapping[str, str] | None = None) -> bool:
    """DDPKIT_SHARE_GPU=1: the user lets several ranks of a node share its GPUs (a test of the
    multi-rank CUDA paths on one GPU; gloo carries the collectives). Unset or 0: one rank per GPU."""
    value = (os.environ if environ is None else environ).get(SHARE_GPU_VAR, "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise DdpkitError(
        f"{SHARE_GPU_VAR}={value!r}: set it to 1 (several ranks share a GPU, over gloo: for testing "
        "multi-rank code on one GPU) or leave it unset"
    )


@dataclass(frozen=True)
class DeviceChoice:
    """A node's device type and backend, and whether its ranks share GPUs (DDPKIT_SHARE_GPU=1,
    more ranks than GPUs): decided from counts alone, so tested without a GPU."""

    device_type: str
    backend: str
    shared: bool = False


def choose_devices(
    device: str, backend: str, local_procs: int, ngpu: int, environ: Mapping[str, str] | None = None
) -> DeviceChoice:
    """--device and --backend for `local_procs` ranks on a node with `ngpu` visible GPUs.
    Ranks share GPUs only when asked (DDPKIT_SHARE_GPU=1) and there are more of them than
    GPUs: then rank i uses GPU i mod ngpu and gloo carries the collectives (staged through
    host memory). Without the opt-in, more ranks than GPUs is refused (check_gpu_count)."""
    if device == "cuda" and ngpu == 0:
        raise DdpkitError("--device cuda was asked for but no CUDA GPU is visible; use --device cpu (or auto)")
    device_type = ("cuda" if ngpu > 0 else "cpu") if device == "auto" else device
    shared = device_type == "cuda" and local_procs > ngpu and share_gpu_opted(environ)
    return DeviceChoice(device_type, resolve_backend(backend, device_type, shared), shared)


def check_gpu_count(nproc: int, ngpu: int, environ: Mapping[str, str] | None = None) -> None:
    """One process per GPU, unless the user lets ranks share them (DDPKIT_SHARE_GPU=1)."""
    if nproc <= ngpu or (ngpu >= 1 and share_gpu_opted(environ)):
        return
    share = (
        f"; or, to test multi-rank code on fewer GPUs, {SHARE_GPU_VAR}=1 lets ranks share them over gloo"
        if ngpu >= 1
        else ""
    )
    raise DdpkitError(
        f"--nproc {nproc} but only {ngpu} GPU(s) are visible: use at most one process per GPU (--nproc {ngpu}){share}"
    )


def gpu_index_of(env: DistEnv, ngpu: int, shared: bool = False) -> int | None:
    """The GPU this rank uses (the launcher's binding); sharing: local rank i takes GPU i mod ngpu."""
    local = env.local_rank % ngpu if shared and ngpu > 0 else env.local_rank
    return env.environment.gpu_index(local, ngpu)


def default_threads(local_world_size: int) -> int:
    """Cores / local processes: more OpenMP threads than cores make DDP several times slower."""
    return max(1, usable_cores() // max(1, local_world_size))


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a SLURM or taskset limit counts)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def select_gpu(env: DistEnv, shared: bool = False) -> torch.device:
    """This rank's GPU, made current before the process group starts (as NCCL requires);
    which one is the launcher's binding (environments/: SLURM may bind one GPU per task), or
    with `shared` (DDPKIT_SHARE_GPU=1) local rank mod the GPUs."""
    ngpu = torch.cuda.device_count()
    index = gpu_index_of(env, ngpu, shared)
    if index is None:
        raise DdpkitError(
            f"local rank {env.local_rank} has no GPU: this node runs {env.local_world_size} "
            f"processes but sees {ngpu} GPU(s); start at most one process per GPU"
        )
    device = torch.device("cuda", index)
    try:
        torch.cuda.set_device(device)
    except RuntimeError as e:  # e.g. a driver too old for this torch's CUDA (the NVML check counted the GPU)
        raise DdpkitError(
            f"cannot use {device}: {str(e).splitlines()[0]}; see `ddpkit env` and nvidia-smi, or use --device cpu"
        ) from None
    return device


def workers_backend(requested: str, device_type: str, local_procs: int) -> str:
    """The backend the workers will take: `requested` (--backend), or NCCL on GPUs, gloo on CPUs
    and where ranks share a GPU (DDPKIT_SHARE_GPU=1)."""
    ngpu = cuda_device_count() if device_type == "cuda" else 0
    return choose_devices(device_type, requested, local_procs, ngpu).backend
