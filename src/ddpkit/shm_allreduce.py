"""Gradient all-reduce through shared memory, for DDP ranks that share one machine's CPU.

Why: gloo moves a gradient bucket between two local processes over TCP loopback: the
kernel copies every byte in and out of a socket, a ring algorithm adds a reduce-scatter
and an all-gather, and all of it runs on cores that backward is already using. On a
9.46M-parameter MLP with 2 processes on 2 cores that is ~30% of a step. Here every rank
writes its (pre-divided) bucket into its slot of a shared mapping, then
  2 ranks:  one barrier, and each rank sums both slots straight into its own bucket;
  3+ ranks: a barrier, rank r sums the r-th part of every slot into a shared result, a
            second barrier, and every rank copies the result into its bucket (the work
            per rank stays ~5 passes over the bucket at any rank count).
No socket, no extra thread.

Correct by construction:
  * The sum is computed the same way on every rank (same slots, same order, same kernel),
    so every replica gets bit-identical gradients. With 2 ranks it equals gloo's result
    bit for bit (x/2 + y/2 is commutative); with more ranks the summation order differs
    from gloo's ring, so results are equal to rounding.
  * No rank writes memory another rank may still read: with 2 ranks two sets of slots
    are used alternately (a set is written again only after the barrier every rank
    reaches once done reading it); with more, the barriers order every write after the
    reads of the previous chunk.
  * The barrier is the process group's own (gloo), so a lost peer ends the run after the
    group's timeout like any other collective; nothing here can wait forever.
  * The mapping is a /dev/shm file unlinked as soon as every rank has opened it, so a
    crash cannot leave it behind (outside a window of a few milliseconds at set-up).
  * Buckets larger than a slot are cut into slot-sized chunks; buckets that are not
    float32 go to the process group's all-reduce: every rank takes the same path.
  * A communication hook the user registers later on the same model replaces this one
    (DDP accepts one hook per model; install() routes the user's registration here).
"""
from __future__ import annotations

import mmap
import os
import secrets
import shutil
from typing import Any

import torch
import torch.distributed as dist

from .errors import DdpkitError

SHM_DIR = "/dev/shm"
MODES = ("auto", "shm", "backend")
DEFAULT_CHUNK_ELEMS = 8 << 20  # 32 MiB of float32 per slot: DDP's default 25 MB buckets in one piece
BUDGET_BYTES = 512 << 20  # with many ranks, slots shrink so that the mapping stays under this
_FREE_SHARE = 0.5  # never take more than half of /dev/shm's free space


def why_not_shm(world_size: int, local_world_size: int, backend: str, device_type: str) -> str | None:
    """None when a shared-memory all-reduce can serve this run, else the reason it cannot."""
    if world_size < 2:
        return "one process: nothing to all-reduce"
    if device_type != "cpu" or backend != "gloo":
        return f"gradients live on {device_type} with {backend}: the backend's own all-reduce is the fast path"
    if local_world_size != world_size:
        return "ranks on several machines do not share memory"
    if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK):
        return f"{SHM_DIR} is not a writable directory"
    return None


class ShmAllReduce:
    """A DDP communication hook (`state` and callable in one) summing buckets in shared memory.

    Build it on every rank at once (it is collective): `ShmAllReduce.create(numel, group)`.
    """

    def __init__(self, buf: torch.Tensor, world: int, rank: int, chunk: int, group: Any, path: str) -> None:
        self.buf = buf  # 2 ranks: [2 sets, 2 slots, chunk]; more: [1, world slots + 1 result, chunk]; float32, shared
        self.world, self.rank, self.chunk, self.group = world, rank, chunk, group
        self.path = path
        self.calls = 0  # chunks reduced so far: picks the set of slots (parity)
        self.fallbacks = 0  # buckets handed to the backend (not float32)
        self.delegate: tuple[Any, Any] | None = None  # (hook, state) the user registered after us

    @classmethod
    def create(cls, numel: int, group: Any = None, chunk_elems: int = DEFAULT_CHUNK_ELEMS) -> "ShmAllReduce":
        """Collective: rank 0 creates the mapping, every rank opens it, rank 0 unlinks it.

        numel is the number of gradient elements DDP will reduce; a slot holds
        min(numel, chunk_elems) of them. Raises DdpkitError on every rank when any rank
        cannot open the mapping or /dev/shm has too little room.
        """
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        shape = (2, 2) if world == 2 else (1, world + 1)  # (sets, slots per set)
        rows = shape[0] * shape[1]
        chunk = max(1, min(int(numel), int(chunk_elems), BUDGET_BYTES // (4 * rows)))
        nbytes = rows * chunk * 4
        path, error = "", ""
        if rank == 0:
            free = shutil.disk_usage(SHM_DIR).free
            if nbytes > _FREE_SHARE * free:
                error = (f"needs {nbytes / 2**20:.0f} MiB of {SHM_DIR}, only {free / 2**20:.0f} MiB free; "
                         f"use --grad-sync backend or give the container a larger {SHM_DIR}")
            else:
                path = os.path.join(SHM_DIR, f"ddpkit-grad-{os.getpid()}-{secrets.token_hex(6)}")
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                    try:
                        os.ftruncate(fd, nbytes)
                    finally:
                        os.close(fd)
                except OSError as e:
                    error, path = f"cannot create {path}: {e.strerror}", ""
        shared = [path, error]
        dist.broadcast_object_list(shared, src=0, group=group)
        path, error = shared
        buf, token = None, None
        if not error:
            try:
                buf = _map(path, nbytes).view(*shape, chunk)
            except OSError as e:
                error = f"rank {rank} cannot map {path}: {e.strerror}"
        # every rank must see the same memory (not, say, a private /dev/shm per container)
        if buf is not None and rank == 0:
            token = torch.randint(1, 2**31 - 1, (1,), dtype=torch.int64)
            buf[0, 0, 0] = float(token.item() % (1 << 24))
        check = torch.tensor([float(token.item() % (1 << 24)) if token is not None else 0.0, 1.0 if error else 0.0],
                             dtype=torch.float64)
        dist.broadcast(check, src=0, group=group)
        seen_ok = buf is not None and float(buf[0, 0, 0]) == check[0].item()
        flags = torch.tensor([0.0 if (seen_ok and not error) else 1.0], dtype=torch.float64)
        dist.all_reduce(flags, group=group)
        if rank == 0 and path:
            os.unlink(path)  # every rank has mapped it (or failed): nothing is left behind
        if flags.item() > 0:
            raise DdpkitError("--grad-sync shm: " + (error or f"ranks do not share {SHM_DIR} (a shared-memory all-reduce needs one machine's memory)"))
        assert buf is not None
        return cls(buf, world, rank, chunk, group, path)

    def reduce_bucket(self, grad: torch.Tensor) -> torch.futures.Future:
        if grad.dtype != torch.float32 or not grad.is_contiguous() or grad.device.type != "cpu":
            self.fallbacks += 1
            grad.div_(self.world)
            return dist.all_reduce(grad, group=self.group, async_op=True).get_future().then(lambda f: f.value()[0])
        self.all_reduce_mean_(grad)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(grad)
        return fut

    def all_reduce_mean_(self, grad: torch.Tensor) -> torch.Tensor:
        """In place: grad <- mean of grad over the ranks (float32, contiguous, CPU)."""
        flat = grad.view(-1)
        world = self.world
        for start in range(0, flat.numel(), self.chunk):
            part = flat[start:start + self.chunk]
            n = part.numel()
            slots = self.buf[self.calls % self.buf.shape[0]]
            self.calls += 1
            torch.div(part, world, out=slots[self.rank, :n])
            dist.barrier(group=self.group)
            if world == 2:
                torch.add(slots[0, :n], slots[1, :n], out=part)
                continue
            lo, hi = n * self.rank // world, n * (self.rank + 1) // world  # this rank's share of the sum
            if hi > lo:
                torch.sum(slots[:world, lo:hi], dim=0, out=slots[world, lo:hi])
            dist.barrier(group=self.group)
            part.copy_(slots[world, :n])
        return grad


def shm_hook(state, bucket):  # type: ignore[no-untyped-def]  (DDP checks annotations: none here)
    """DDP communication hook: `state` is the ShmAllReduce, `bucket` DDP's GradBucket (or,
    from DDP's Python reducer under compiled autograd, a (grad, param) pair reduced in place)."""
    if state.delegate is not None:
        hook, user_state = state.delegate
        return hook(user_state, bucket)
    if isinstance(bucket, tuple):
        grad = bucket[0]
        if grad.dtype == torch.float32 and grad.is_contiguous() and grad.device.type == "cpu":
            state.all_reduce_mean_(grad)
        else:
            grad.div_(state.world)
            dist.all_reduce(grad, group=state.group)
        return None
    return state.reduce_bucket(bucket.buffer())


def _route_user_hooks(ddp_model: Any, state: ShmAllReduce, backend: str) -> None:
    """Let `ddp_model.register_comm_hook(state, hook)` (and DDP's built-in hook types) work
    after ddpkit installed its hook: the user's hook takes over every bucket, as it would
    on a plain DDP model, and the shared mapping is released."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def register_comm_hook(user_state: object, hook: Any) -> None:
        if state.delegate is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        ddp_model._check_comm_hook(hook)
        if ddp_model.logger is not None:
            ddp_model.logger._set_comm_hook_name(hook.__qualname__)
        state.delegate = (hook, user_state)
        state.buf = None  # the user's hook does the communication now
        ddp_model._ddpkit_grad_sync = backend

    def register_builtin_comm_hook(comm_hook_type: Any) -> None:
        builtin = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                   dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
        if comm_hook_type not in builtin:
            raise DdpkitError(f"built-in comm hook {comm_hook_type} unknown to ddpkit; wrap the model with grad_sync='backend'")
        register_comm_hook(None, builtin[comm_hook_type])

    ddp_model.register_comm_hook = register_comm_hook
    ddp_model._register_builtin_comm_hook = register_builtin_comm_hook


def _map(path: str, nbytes: int) -> torch.Tensor:
    """A float32 tensor over the shared mapping of `path` (MAP_SHARED, read-write)."""
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    t = torch.frombuffer(mm, dtype=torch.float32)
    t._ddpkit_mmap = mm  # type: ignore[attr-defined]  (keep the mapping alive with the tensor)
    return t


def install(ddp_model: Any, mode: str, local_world_size: int, backend: str, device_type: str,
            say: Any = None) -> ShmAllReduce | None:
    """Register the shared-memory hook on a DDP model for --grad-sync auto|shm (None: not used).

    `auto` uses it where it can (one machine, CPU, gloo) and quietly keeps the backend
    otherwise; `shm` insists and raises DdpkitError with the reason when it cannot.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    if mode not in MODES:
        raise DdpkitError(f"--grad-sync must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "backend" or not isinstance(ddp_model, DDP):
        return None
    reason = why_not_shm(dist.get_world_size(), local_world_size, backend, device_type)
    if reason is not None:
        if mode == "shm":
            raise DdpkitError(f"--grad-sync shm: {reason}; use --grad-sync auto or backend")
        return None
    numel = sum(p.numel() for p in ddp_model.module.parameters() if p.requires_grad)
    try:
        state = ShmAllReduce.create(numel)  # collective: every rank gets the mapping, or every rank raises
    except DdpkitError as e:
        if mode == "shm":
            raise
        if say is not None:
            say(f"ddpkit: gradients all-reduced by {backend}: {str(e).removeprefix('--grad-sync shm: ')}")
        return None
    ddp_model.register_comm_hook(state, shm_hook)
    _route_user_hooks(ddp_model, state, backend)
    return state
