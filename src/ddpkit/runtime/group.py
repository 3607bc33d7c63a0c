"""The process group up and down: device, backend, threads, timeout.

Everything a worker needs between "I know my rank" (environments) and "train" (training).
What a user's own loop gets on top of it (wrap, loader, save, load) is ownloop/session.py's
Session, which holds a Runtime and shows the same face (RankView).
"""

from __future__ import annotations

import gc
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from ..config.processes import DEFAULT_TIMEOUT_S
from ..environments import DistEnv
from ..parallel.dims import ParallelDims
from .collectives import Collectives
from .debug import apply_debug_level
from .devices import choose_devices, cuda_device_count, default_threads, resolve_device_type, select_gpu
from .record import CollectiveRecord
from .store import make_store

_View = TypeVar("_View", bound="RankView")


class RankView:
    """The job as one rank sees it: its rank and the world's size, print on rank 0, the sum and
    the object collectives, a barrier, and a context manager that closes it. Runtime is one;
    the own loop's Session holds a Runtime and shows the same face, written once here."""

    env: DistEnv
    device: torch.device
    backend: str
    collectives: Collectives

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_initialized() and self.world_size > 1

    @property
    def collective_device(self) -> torch.device:
        """Where a small tensor for a collective goes: this rank's GPU under NCCL (it moves
        CUDA tensors only), the CPU under gloo."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on rank 0 only."""
        if self.is_main:
            kwargs.setdefault("flush", True)
            print(*args, **kwargs)

    def all_sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of `value` over all ranks (a new tensor), by the job's fastest path."""
        return self.collectives.all_sum(value)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (just [obj] alone)."""
        if not self.distributed:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def close(self) -> None:
        """Tear the process group down (each kind of view knows what it holds)."""
        raise NotImplementedError

    def __enter__(self: _View) -> _View:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Runtime(RankView):
    """This process's share of the job: env, device, backend, the process group, the job's
    collectives (`rt.collectives`: shared memory or the backend) and the record of every
    collective this rank issued (`rt.record`, what a hang report shows).

    Use as a context manager (or call close()): the group is torn down on every exit path.
    The open Runtime is the one ddpkit.all_sum reaches (Runtime.active()); it is the only
    state ddpkit keeps beside the process group, and it lives exactly as long.
    """

    _active: Runtime | None = None

    def __init__(
        self,
        env: DistEnv,
        device: str = "auto",
        backend: str = "auto",
        timeout: float = DEFAULT_TIMEOUT_S,
        threads: int | None = None,
        store: Any = None,
    ) -> None:
        """`store`: the workers' store when the caller made it already (make_store), else made here."""
        self.env = env
        # the job's mesh (parallel/dims.py): every rank data-parallel until the run lays out its own
        self.dims = ParallelDims(dp_replicate=max(1, env.world_size), rank=env.rank)
        torch.set_num_threads(threads or default_threads(env.local_world_size))
        device_type = resolve_device_type(device)
        # DDPKIT_SHARE_GPU=1 with more local ranks than GPUs: they share them, over gloo (devices.py)
        ngpu = cuda_device_count() if device_type == "cuda" else 0
        choice = choose_devices(device_type, backend, env.local_world_size, ngpu)
        self.backend = choice.backend
        self.shares_gpu = choice.shared
        if device_type == "cuda":
            self.device = select_gpu(env, choice.shared)
        else:
            self.device = torch.device("cpu")
        self.timeout = timeout
        self.record = CollectiveRecord()
        self.collectives = Collectives(self.record)
        self._owns_group = False
        self._store: Any = None
        if env.distributed and not dist.is_initialized():
            apply_debug_level()  # --debug-collectives in a worker forked after torch was imported, and DDP under it
            kwargs: dict[str, Any] = {}
            if device_type == "cuda":
                kwargs["device_id"] = self.device
            # held for the group's life: a sealed store (runtime/sealed.py) is a Python object whose C++ part
            # is all torch keeps, and rank 0's TCPStore server inside it would go with it when collected
            self._store = store if store is not None else make_store(env, timeout)
            dist.init_process_group(
                self.backend,
                store=self._store,
                rank=env.rank,
                world_size=env.world_size,
                timeout=timedelta(seconds=timeout),
                **kwargs,
            )
            self._owns_group = True
        if self.shares_gpu and env.local_rank == 0:
            print(
                f"ddpkit: DDPKIT_SHARE_GPU=1: {env.local_world_size} ranks share {cuda_device_count()} GPU(s) over "
                "gloo (collectives staged through host memory): a test of the multi-rank code, not of NCCL",
                flush=True,
            )
        Runtime._active = self

    @classmethod
    def active(cls) -> Runtime | None:
        """The Runtime this process opened last and has not closed (None: none is open)."""
        return cls._active

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` on rank 0, in rank order; None elsewhere. What only rank 0 writes
        needs no all-gather: that would hand every rank all of them (world^2 in all)."""
        if not self.distributed:
            return [obj]
        gathered: list[Any] | None = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, gathered, dst=0)
        return gathered

    def pass_objects(self, moves: list[tuple[int, int]], send: Callable[[int], Any]) -> Any:
        """Point to point, every rank walking the same `moves` ((source, destination) ranks) in
        the same order: a source sends `send(destination)`, a destination receives; returns what
        this rank received last (None if nothing). Each move's two ranks are done with every
        earlier move when they reach it, so the walk cannot deadlock; the others take no part."""
        got = None
        for src, dst in moves:
            if self.rank == src:
                dist.send_object_list([send(dst)], dst=dst)
            elif self.rank == dst:
                box: list[Any] = [None]
                dist.recv_object_list(box, src=src)
                got = box[0]
        return got

    def close(self) -> None:
        """Tear the process group down. Objects that hold it (the DDP model, optimizer)
        must be gone first: torch 2.13 aborts at exit in ~9% of runs otherwise."""
        self.collectives = Collectives(self.record)  # the mapping belongs to this group
        if Runtime._active is self:
            Runtime._active = None
        if self._owns_group and dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()
        self._owns_group = False
        self._store = None


def all_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all ranks (a copy; identity without a process group). Always through
    the process group, whatever the tensor's size or device, and written to the active
    Runtime's record, so a hang report sees a user's all_sum next to ddpkit's own."""
    rt = Runtime.active()
    return Collectives(rt.record if rt is not None else None).all_sum(value)


def mean_across_ranks(value: float | torch.Tensor, device: torch.device | None = None) -> float:
    """The mean of one number over all ranks (what every rank would print as 'the' loss)."""
    t = torch.as_tensor(value, dtype=torch.float64, device=device or _collective_device())
    world = dist.get_world_size() if dist.is_initialized() else 1
    return float(all_sum(t).item()) / world


def _collective_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
