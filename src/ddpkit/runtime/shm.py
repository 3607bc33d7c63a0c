"""Gradient all-reduce through shared memory, for DDP ranks that share one machine's CPU.

Why: gloo moves a gradient bucket between two local processes over TCP loopback: the
kernel copies every byte in and out of a socket, a ring algorithm adds a reduce-scatter
and an all-gather, and all of it runs on cores that backward is already using. On a
9.46M-parameter MLP with 2 processes on 2 cores that is ~30% of a step. Here every rank
writes its (pre-divided) bucket into its slot of a shared mapping, then
  2 ranks:  one barrier, and each rank sums both slots straight into its own bucket, 2 MiB
            at a time (the sum then reads from cache what was just written);
  3+ ranks: a barrier, rank r sums the r-th part of every slot into a shared result, a
            second barrier, and every rank copies the result into its bucket (the work
            per rank stays ~5 passes over the bucket at any rank count).
No socket, no extra thread. The barrier (x86) is a counter per rank in the mapping: a
rank raises its own, then reads the others' until they match, spinning ~0.1 ms before
yielding the core. gloo's barrier costs 0.2 ms back to back and ~1 ms inside a training
step on 2 busy cores (its network thread must be scheduled); this one ~1 us. The job's
small all-reduces (the trainer's loss sums, NaN/stop flags, evaluation counts: up to
SMALL_MAX numbers) take the same path (runtime/collectives.py chooses it). Measured on 2 cores: a
Wine DDP step 1.7 ms -> 0.43 ms (the no-sync step is 0.35 ms), 100 Wine epochs train
in 0.23 s instead of 0.87 s; an MLP step (9.46M parameters) 158 ms -> 130 ms (no-sync 116).

Correct by construction:
  * The sum is computed the same way on every rank (same slots, same order, same kernel),
    so every replica gets bit-identical gradients. With 2 ranks it equals gloo's result
    bit for bit (x/2 + y/2 is commutative); with more ranks the summation order differs
    from gloo's ring, so results are equal to rounding.
  * No rank writes memory another rank may still read: with 2 ranks two sets of slots
    are used alternately (a set is written again only after the barrier every rank
    reaches once done reading it); with more, the barriers order every write after the
    reads of the previous chunk.
  * No wait is unbounded: a rank that does not arrive within the process group's timeout
    (--timeout) makes the others fail with its rank named; a rank that dies is noticed by
    the elastic agent, which stops the group, as with any collective. On other CPUs than
    x86, whose stores may become visible out of order, the barrier is the process
    group's own and small all-reduces stay with the process group.
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
import platform
import secrets
import shutil
import time
from typing import Any

import torch
import torch.distributed as dist

from ..config.processes import DEFAULT_TIMEOUT_S
from ..errors import DdpkitError
from .record import CollectiveRecord

SHM_DIR = "/dev/shm"
DEFAULT_CHUNK_ELEMS = 8 << 20  # 3+ ranks: 32 MiB of float32 per slot: DDP's default 25 MB buckets in one piece
# 2 ranks: 2 MiB slots, so a bucket goes through in pieces (the two sets of slots alternate, a
# barrier each) whose writes the sum reads back from the shared cache, not from memory: a
# 38 MB bucket in ~9 ms instead of ~14 (benchmarks/shm_sum_passes.py)
PAIR_CHUNK_ELEMS = 1 << 19
BUDGET_BYTES = 512 << 20  # with many ranks, slots shrink so that the mapping stays under this
_FREE_SHARE = 0.5  # never take more than half of /dev/shm's free space
_CTL_STRIDE = 16  # int64 words per rank in the control block: one 128-byte line each
SMALL_MAX = 32  # elements: all-reduces up to this size (loss sums, flags) go through the mapping too
_SPIN_FAST = 2000  # flag reads (~0.1 ms) before yielding the core
_SPIN_YIELD = 20000  # then sched_yield; after that, 0.2 ms sleeps until the deadline
# Plain stores become visible to other cores in program order only on x86 (TSO): there the
# barrier is a flag per rank in the mapping; elsewhere it is the process group's barrier.
SPIN_BARRIER = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


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


def _create_file(nbytes: int) -> tuple[str, str]:
    """Rank 0: a new file of `nbytes` in SHM_DIR, unless it would take too much of the room left:
    (its path, "") or ("", why not)."""
    free = shutil.disk_usage(SHM_DIR).free
    if nbytes > _FREE_SHARE * free:
        return "", (
            f"needs {nbytes / 2**20:.0f} MiB of {SHM_DIR}, only {free / 2**20:.0f} MiB free; "
            f"use --grad-sync backend or give the container a larger {SHM_DIR}"
        )
    path = os.path.join(SHM_DIR, f"ddpkit-grad-{os.getpid()}-{secrets.token_hex(6)}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
    except OSError as e:
        return "", f"cannot create {path}: {e.strerror}"
    return path, ""


def _map_views(
    path: str, nbytes: int, ctl_bytes: int, flags_bytes: int, shape: tuple[int, int], chunk: int, world: int
) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
    """The file mapped: the slots (sets x slots x chunk floats, after the control pages) and, with
    SPIN_BARRIER, the flags and the small slots in the control pages (else None). OSError: not mapped."""
    mm = _map(path, nbytes)
    buf = torch.frombuffer(mm, dtype=torch.float32, offset=ctl_bytes).view(*shape, chunk)
    buf._ddpkit_mmap = mm  # type: ignore[attr-defined]  (the mapping lives as long as the tensor)
    ctl, small = None, None
    if SPIN_BARRIER:
        ctl = memoryview(mm)[:flags_bytes].cast("q")
        small = torch.frombuffer(mm, dtype=torch.float64, offset=flags_bytes, count=2 * world * SMALL_MAX).view(
            2, world, SMALL_MAX
        )
    return buf, ctl, small


class ShmAllReduce:
    """A DDP communication hook (`state` and callable in one) summing buckets in shared memory.

    Build it on every rank at once (it is collective): `ShmAllReduce.create(numel, group)`.
    """

    def __init__(
        self,
        buf: torch.Tensor,
        world: int,
        rank: int,
        chunk: int,
        group: Any,
        path: str,
        ctl: memoryview | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.ctl = ctl  # int64 flags, one per rank every _CTL_STRIDE words: barriers passed (None: use dist.barrier)
        self.small: torch.Tensor | None = None  # [2 sets, world, SMALL_MAX] float64 (x86 only)
        self.small_calls = 0
        self.generation = 0
        self.timeout = timeout
        self.buf = buf  # 2 ranks: [2 sets, 2 slots, chunk]; more: [1, world slots + 1 result, chunk]; float32, shared
        self.world, self.rank, self.chunk = world, rank, chunk
        self.group = dist.group.WORLD if group is None else group  # the group this mapping serves
        self.path = path
        self.calls = 0  # chunks reduced so far: picks the set of slots (parity)
        self.fallbacks = 0  # buckets handed to the backend (not float32)
        self.delegate: tuple[Any, Any] | None = None  # (hook, state) the user registered after us
        self.record = CollectiveRecord()  # the job's record once a Collectives serves through this mapping
        self.agreement: Any = None  # strategies/agreement.py: the step's flags, carried by the first bucket
        self.waited_s = 0.0  # seconds spent in barriers (waiting for the other ranks), in all

    @classmethod
    def create(
        cls, numel: int, group: Any = None, chunk_elems: int | None = None, timeout: float = DEFAULT_TIMEOUT_S
    ) -> ShmAllReduce:
        """Collective: rank 0 creates the mapping, every rank opens it, rank 0 unlinks it.

        numel is the number of gradient elements DDP will reduce; a slot holds
        min(numel, chunk_elems) of them (default: PAIR_CHUNK_ELEMS for 2 ranks, else
        DEFAULT_CHUNK_ELEMS). Raises DdpkitError on every rank when any rank
        cannot open the mapping or /dev/shm has too little room. `timeout`: seconds a
        barrier waits for the other ranks before it fails (give the process group's).
        """
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        shape = (2, 2) if world == 2 else (1, world + 1)  # (sets, slots per set)
        if chunk_elems is None:
            chunk_elems = PAIR_CHUNK_ELEMS if world == 2 else DEFAULT_CHUNK_ELEMS
        rows = shape[0] * shape[1]
        chunk = max(1, min(int(numel), int(chunk_elems), BUDGET_BYTES // (4 * rows)))
        flags_bytes = world * _CTL_STRIDE * 8
        ctl_bytes = -(-(flags_bytes + 2 * world * SMALL_MAX * 8) // 4096) * 4096  # flags + small slots, whole pages
        nbytes = ctl_bytes + rows * chunk * 4
        shared = list(_create_file(nbytes)) if rank == 0 else ["", ""]
        dist.broadcast_object_list(shared, src=0, group=group)
        path, error = shared
        buf, token, ctl, small = None, None, None, None
        if not error:
            try:
                buf, ctl, small = _map_views(path, nbytes, ctl_bytes, flags_bytes, shape, chunk, world)
            except OSError as e:
                error = f"rank {rank} cannot map {path}: {e.strerror}"
        # every rank must see the same memory (not, say, a private /dev/shm per container)
        if buf is not None and rank == 0:
            token = torch.randint(1, 2**31 - 1, (1,), dtype=torch.int64)
            buf[0, 0, 0] = float(token.item() % (1 << 24))
        check = torch.tensor([float(token.item() % (1 << 24)) if token is not None else 0.0], dtype=torch.float64)
        dist.broadcast(check, src=0, group=group)
        if not error and float(buf[0, 0, 0]) != check.item():  # type: ignore[index]
            error = (
                f"rank {rank} does not see rank 0's {SHM_DIR} (a shared-memory all-reduce needs one machine's memory)"
            )
        failed = torch.tensor([1.0 if error else 0.0], dtype=torch.float64)
        dist.all_reduce(failed, group=group)
        if rank == 0 and path:
            os.unlink(path)  # every rank has mapped it (or failed): nothing is left behind
        if failed.item() > 0:
            raise DdpkitError(
                "--grad-sync shm: "
                + (
                    error
                    or "another rank could not use the shared gradient buffer "
                    f"(ranks must share one machine's {SHM_DIR})"
                )
            )
        assert buf is not None
        state = cls(buf, world, rank, chunk, group, path, ctl, timeout)
        state.small = small
        return state

    @staticmethod
    def fits(grad: torch.Tensor) -> bool:
        """Can the mapping sum this gradient? (float32, contiguous, CPU; else the backend does)"""
        return grad.dtype == torch.float32 and grad.is_contiguous() and grad.device.type == "cpu"

    def reduce_bucket(self, grad: torch.Tensor, carry: torch.Tensor | None = None) -> torch.futures.Future:
        """The mean of a gradient bucket; `carry` (up to SMALL_MAX numbers, or None) is summed in
        place over the ranks in the same barrier as the bucket's first chunk."""
        if not self.fits(grad):
            self.fallbacks += 1
            grad.div_(self.world)
            return dist.all_reduce(grad, group=self.group, async_op=True).get_future().then(lambda f: f.value()[0])
        self.all_reduce_mean_(grad, carry)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(grad)
        return fut

    def all_reduce_mean_(self, grad: torch.Tensor, carry: torch.Tensor | None = None) -> torch.Tensor:
        """In place: grad <- mean of grad over the ranks (float32, contiguous, CPU); `carry`
        (see reduce_bucket; only where fits_small) <- its sum."""
        with self.record.track("all_reduce", grad, "shm", "gradient bucket"):  # for a hang report (runtime/record.py)
            return self._all_reduce_mean(grad, carry)

    def _all_reduce_mean(self, grad: torch.Tensor, carry: torch.Tensor | None = None) -> torch.Tensor:
        flat = grad.view(-1)
        world = self.world
        for start in range(0, flat.numel(), self.chunk):
            part = flat[start : start + self.chunk]
            n = part.numel()
            slots = self.buf[self.calls % self.buf.shape[0]]
            self.calls += 1
            torch.div(part, world, out=slots[self.rank, :n])
            small = self._put_small(carry) if start == 0 and carry is not None else None
            self.barrier()
            if small is not None:
                assert carry is not None
                self._sum_small(carry, small)
            if world == 2:
                torch.add(slots[0, :n], slots[1, :n], out=part)
                continue
            lo, hi = n * self.rank // world, n * (self.rank + 1) // world  # this rank's share of the sum
            if hi > lo:
                torch.sum(slots[:world, lo:hi], dim=0, out=slots[world, lo:hi])
            self.barrier()
            part.copy_(slots[world, :n])
        return grad

    def fits_small(self, t: torch.Tensor) -> bool:
        """Can all_reduce_small serve `t`? (the same answer on every rank of a job)"""
        return self.small is not None and t.numel() <= SMALL_MAX and t.device.type == "cpu" and not t.is_complex()

    def all_reduce_small(self, t: torch.Tensor, op: str = "sum") -> bool:
        """In place, like dist.all_reduce(t) (sum) or with ReduceOp.MAX (op='max'), for up to
        SMALL_MAX elements on the CPU; False (nothing done) when this path cannot serve it.
        Every rank adds the slots in rank order, so all get the same value; with 2 ranks it is
        gloo's value (a + b == b + a). Values pass through float64: exact for counts < 2**53."""
        if not self.fits_small(t):
            return False
        slots = self._put_small(t)
        self.barrier()
        self._sum_small(t, slots, op)
        return True

    def _put_small(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's values of `t` into its slot of the next set (sets alternate: a set is
        written again only after a later barrier, which every rank passes once done reading it)."""
        slots = self.small[self.small_calls % 2]  # type: ignore[index]
        self.small_calls += 1
        slots[self.rank, : t.numel()].copy_(t.detach().reshape(-1))
        return slots

    @staticmethod
    def _sum_small(t: torch.Tensor, slots: torch.Tensor, op: str = "sum") -> None:
        """After the barrier: `t` <- the ranks' values summed (or their max) in rank order."""
        mine = slots[:, : t.numel()]
        total = mine.sum(dim=0) if op == "sum" else mine.amax(dim=0)
        with torch.no_grad():
            t.copy_(total.view(t.shape))

    def barrier(self) -> None:
        """Wait until every rank has reached this point (as often as this rank has).

        x86: each rank raises its own counter in the control block, then reads the others'
        until they reach it: ~1 us when the others are there, where gloo's barrier costs
        0.2-1 ms on a busy machine. A wait longer than the process group's timeout ends
        with an error naming the rank that did not arrive. Elsewhere: dist.barrier.
        """
        t0 = time.perf_counter()
        try:
            self._barrier()
        finally:
            self.waited_s += time.perf_counter() - t0

    def _barrier(self) -> None:
        ctl = self.ctl
        if ctl is None:
            dist.barrier(group=self.group)
            return
        self.generation = gen = self.generation + 1
        ctl[self.rank * _CTL_STRIDE] = gen  # after the slot writes: x86 keeps stores in order
        for peer in range(self.world):
            at = peer * _CTL_STRIDE
            spins = 0
            deadline = 0.0
            while ctl[at] < gen:
                spins += 1
                if spins < _SPIN_FAST:
                    continue
                if spins == _SPIN_FAST:
                    deadline = time.monotonic() + self.timeout
                elif time.monotonic() > deadline:
                    raise DdpkitError(
                        f"rank {self.rank} waited {self.timeout:g} s (--timeout) for rank {peer} to reach the "
                        "same all-reduce (gradients or loss sums): it hangs, or it runs other collectives"
                    )
                if spins < _SPIN_YIELD:
                    os.sched_yield()
                else:
                    time.sleep(0.0002)


def _map(path: str, nbytes: int) -> mmap.mmap:
    """The shared mapping of `path` (MAP_SHARED, read-write)."""
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
