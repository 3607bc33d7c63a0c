"""Run under `ddpkit launch --nproc N`: ddpkit's shared-memory all-reduce against gloo's.

Checks, on every rank, and prints "SHM OK <world>" on rank 0 when all hold:
  * mean over ranks equals gloo's all_reduce / world (bit for bit with 2 ranks, to
    rounding with more), for sizes around the slot size (chunks of 7 elements);
  * every rank ends with bit-identical values (the replicas cannot drift apart);
  * a float64 bucket goes through the backend and is still the mean;
  * the /dev/shm file is gone once create() has returned on every rank;
  * small all-reduces (sum and max, float64, float32 and int64) equal gloo's; longer ones
    are left to the process group;
  * a rank that does not arrive at a barrier makes the others fail after the timeout,
    naming it (x86's flag barrier), and the barrier works again afterwards;
  * a comm hook the user registers on rt.wrap's model takes over, with the gradients a
    plain DDP model with that hook gets; a second registration is refused as DDP does;
  * too little room in /dev/shm: `shm` raises the same error on every rank, `auto` falls
    back to the backend and says so.
"""
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import ddpkit
from ddpkit.errors import DdpkitError
from ddpkit.runtime import shm as S
from ddpkit.strategies import grad_sync as G
from ddpkit.strategies import grad_sync_used

rt = ddpkit.init(threads=1)
rank, world = rt.rank, rt.world_size
before = {f for f in os.listdir(S.SHM_DIR) if f.startswith("ddpkit-grad-")}
state = S.ShmAllReduce.create(1000, chunk_elems=7)
dist.barrier()  # rank 0 unlinks right after the others have mapped it: look once it is past that
after = {f for f in os.listdir(S.SHM_DIR) if f.startswith("ddpkit-grad-")}
assert not (after - before), f"left in {S.SHM_DIR}: {after - before}"

for n in (1, 6, 7, 8, 15, 100, 1000):
    g = torch.Generator().manual_seed(1000 * rank + n)
    x = torch.randn(n, generator=g) * (rank + 1)
    ref = x.clone() / world
    dist.all_reduce(ref)
    got = state.all_reduce_mean_(x.clone())
    if world == 2:
        assert torch.equal(got, ref), (n, (got - ref).abs().max())
    else:
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    every = [torch.empty_like(got) for _ in range(world)]
    dist.all_gather(every, got)
    assert all(torch.equal(e, every[0]) for e in every), f"ranks differ for n={n}"

if S.SPIN_BARRIER:
    for dtype in (torch.float64, torch.float32, torch.int64):
        v = (torch.arange(5) * (rank + 1) + rank).to(dtype)
        ref = v.clone()
        dist.all_reduce(ref)
        got = v.clone()
        assert state.all_reduce_small(got), dtype
        assert torch.equal(got, ref), (dtype, got, ref)
        mx = v.clone()
        assert state.all_reduce_small(mx, op="max")
        ref = v.clone()
        dist.all_reduce(ref, op=dist.ReduceOp.MAX)
        assert torch.equal(mx, ref), (dtype, mx, ref)
    assert not state.all_reduce_small(torch.zeros(S.SMALL_MAX + 1))

    state.timeout = 1.0
    if rank == 0:
        import time
        t0 = time.monotonic()
        try:
            state.barrier()
            raise AssertionError("the barrier should have timed out")
        except DdpkitError as e:
            assert "waited 1 s (--timeout) for rank 1" in str(e), e
            # it gave up once the timeout had passed, not before; a barrier that never gave up
            # would hang this script until the test's subprocess timeout fails it
            assert time.monotonic() - t0 >= state.timeout
    dist.barrier()  # rank 0 gave up; now the others pass the barrier rank 0 already counted
    if rank != 0:
        state.barrier()
    state.timeout = 300.0
    state.barrier()  # counters agree again

x64 = torch.full((5,), float(rank + 1), dtype=torch.float64)
out = state.reduce_bucket(x64).wait()
assert torch.allclose(out, torch.full((5,), (world + 1) / 2, dtype=torch.float64)), out
assert state.fallbacks == 1



def grads_with_fp16_hook(model):
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    torch.manual_seed(10 + rank)
    model(torch.randn(8, 16)).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def fresh():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


wrapped = rt.wrap(fresh())
assert grad_sync_used(wrapped) == "shm"
mine = grads_with_fp16_hook(wrapped)
assert grad_sync_used(wrapped) == "gloo"
plain = grads_with_fp16_hook(nn.parallel.DistributedDataParallel(fresh()))
assert all(torch.equal(a, b) for a, b in zip(mine, plain, strict=True)), "the user's hook did not take over"
try:
    wrapped.register_comm_hook(None, default_hooks.allreduce_hook)
    raise AssertionError("a second hook should be refused")
except RuntimeError as e:
    assert "only be called once" in str(e)

S._FREE_SHARE = 1e-12  # pretend /dev/shm is full
try:
    S.ShmAllReduce.create(1000)
    raise AssertionError("create() should have refused")
except DdpkitError as e:
    assert "MiB free" in str(e) and "--grad-sync backend" in str(e), e
said = []
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
assert G.install(model, "auto", world, "gloo", "cpu", say=said.append) is None
assert len(said) == 1 and "all-reduced by gloo" in said[0], said
try:
    G.install(nn.parallel.DistributedDataParallel(nn.Linear(4, 2)), "shm", world, "gloo", "cpu")
    raise AssertionError("install(shm) should have refused")
except DdpkitError as e:
    assert "--grad-sync shm" in str(e)
del state
rt.print(f"SHM OK {world}")
rt.close()
sys.exit(0)
