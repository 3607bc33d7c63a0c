"""Process group up and down: device, backend, threads, timeout; cross-rank helpers.

Everything a worker needs between "I know my rank" (env) and "train" (trainer).
"""
from __future__ import annotations

import gc
import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .env import DistEnv
from .errors import DdpkitError
from .shm_allreduce import all_reduce_small


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


class Runtime:
    """This process's share of the job: env, device, backend, and the process group.

    Use as a context manager (or call close()): the group is torn down on every exit path.
    """

    def __init__(
        self,
        env: DistEnv,
        device: str = "auto",
        backend: str = "auto",
        timeout: float = 300.0,
        threads: int | None = None,
    ) -> None:
        self.env = env
        torch.set_num_threads(threads or default_threads(env.local_world_size))
        device_type = resolve_device_type(device)
        self.backend = resolve_backend(backend, device_type)
        if device_type == "cuda":
            ngpu = torch.cuda.device_count()
            if env.local_rank < ngpu:
                index = env.local_rank
            elif ngpu == 1 and env.launcher == "slurm":
                index = 0  # SLURM bound one GPU to this task (--gpus-per-task / --gpu-bind)
            else:
                raise DdpkitError(
                    f"local rank {env.local_rank} has no GPU: this node runs {env.local_world_size} "
                    f"processes but sees {ngpu} GPU(s); start at most one process per GPU"
                )
            self.device = torch.device("cuda", index)
            torch.cuda.set_device(self.device)  # before the process group, as NCCL requires
        else:
            self.device = torch.device("cpu")
        self.timeout = timeout
        self._owns_group = False
        if env.distributed and not dist.is_initialized():
            kwargs: dict[str, Any] = {}
            if device_type == "cuda":
                kwargs["device_id"] = self.device
            dist.init_process_group(
                self.backend,
                store=make_store(env, timeout),
                rank=env.rank,
                world_size=env.world_size,
                timeout=timedelta(seconds=timeout),
                **kwargs,
            )
            self._owns_group = True

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on rank 0 only."""
        if self.is_main:
            kwargs.setdefault("flush", True)
            print(*args, **kwargs)

    def wrap(self, model: "torch.nn.Module", grad_sync: str = "auto", **ddp_options: Any) -> "torch.nn.Module":
        """The model on this rank's device, in DDP when there are several ranks (DDP's
        keyword arguments pass through). grad_sync='auto' all-reduces CPU gradients of
        ranks on one machine through shared memory ('backend': gloo/NCCL); a
        communication hook you register on the returned model takes over."""
        from .parallel import wrap_model

        return wrap_model(model, self, grad_sync, **ddp_options)

    def loader(self, dataset: Any, batch_size: int, shuffle: bool = True, seed: int = 0, **kwargs: Any) -> Any:
        """This rank's batches of `dataset` (batch_size per process), in ddpkit's global
        order: call .set_epoch(epoch) on it before each epoch."""
        from .data import ShardedLoader

        return ShardedLoader(dataset, batch_size, self.rank, self.world_size, seed=seed, shuffle=shuffle, **kwargs)

    def save(self, path: str, model: "torch.nn.Module", optimizer: Any = None, **extra: Any) -> None:
        """Rank 0 writes model (unwrapped), optimizer and `extra` atomically; all ranks wait."""
        from .checkpoint import save_state

        if self.is_main:
            save_state(path, model, optimizer, **extra)
        self.barrier()

    def load(self, path: str, model: "torch.nn.Module", optimizer: Any = None) -> dict[str, Any]:
        """Load what save() wrote into model/optimizer on every rank; returns the extras."""
        from .checkpoint import load_state

        return load_state(path, model, optimizer)

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def close(self) -> None:
        """Tear the process group down. Objects that hold it (the DDP model, optimizer)
        must be gone first: torch 2.13 aborts at exit in ~9% of runs otherwise."""
        if self._owns_group and dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()
        self._owns_group = False

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def make_store(env: DistEnv, timeout: float) -> dist.Store:
    """The workers' key-value store. Rank 0 serves it on the master address only (torch's
    default listens on every interface); under torch's elastic agent with a shared store
    (static rendezvous), every rank is a client of the agent's store, as torchrun does."""
    wait = timedelta(seconds=timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, False, wait)
        return dist.PrefixStore(f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    if env.rank != 0:
        return dist.TCPStore(env.master_addr, env.master_port, env.world_size, False, wait)
    fd = bound_listener(env.master_addr, env.master_port).detach()  # the store owns the socket now
    return dist.TCPStore(env.master_addr, env.master_port, env.world_size, True, wait, master_listen_fd=fd)


def bound_listener(host: str, port: int) -> socket.socket:
    """A listening socket on exactly host:port (not all interfaces)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    addr = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)[0][4]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise DdpkitError(f"cannot listen on the master address {host}:{port} ({e.strerror}); "
                          "is the port in use, or is the address not this node's?") from None
    return sock


def all_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all ranks (a copy; identity without a process group)."""
    out = value.detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        if not all_reduce_small(out):  # CPU ranks on one machine: through shared memory (~1 us, not ~0.3 ms)
            dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def mean_across_ranks(value: float | torch.Tensor, device: torch.device | None = None) -> float:
    """The mean of one number over all ranks (what every rank would print as 'the' loss)."""
    t = torch.as_tensor(value, dtype=torch.float64, device=device or _collective_device())
    world = dist.get_world_size() if dist.is_initialized() else 1
    return float(all_sum(t).item()) / world


def _collective_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _bracket(addr: str) -> str:
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr
