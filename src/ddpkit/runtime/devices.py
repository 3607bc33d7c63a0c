"""Which device, backend and thread count this process uses: decided before the process
group exists, so the launcher can refuse a bad request before any worker starts."""

from __future__ import annotations

import os

import torch

from ..environments import DistEnv
from ..errors import DdpkitError


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


def resolve_backend(requested: str, device_type: str) -> str:
    """NCCL for GPUs, gloo for CPUs. NCCL without a GPU is refused, not attempted."""
    if requested == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if requested == "nccl" and device_type != "cuda":
        raise DdpkitError("--backend nccl needs a CUDA GPU and none is in use; use --backend gloo (or auto)")
    return requested


def default_threads(local_world_size: int) -> int:
    """Cores / local processes: more OpenMP threads than cores make DDP several times slower."""
    return max(1, usable_cores() // max(1, local_world_size))


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a SLURM or taskset limit counts)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def select_gpu(env: DistEnv) -> torch.device:
    """This rank's GPU, made current before the process group starts (as NCCL requires);
    which one is the launcher's binding (environments/: SLURM may bind one GPU per task)."""
    ngpu = torch.cuda.device_count()
    index = env.environment.gpu_index(env.local_rank, ngpu)
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
