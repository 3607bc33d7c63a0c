"""runtime/: device, backend and thread choices, the store's listener, the Runtime of one
process, and the one place that chooses how small all-reduces travel (Collectives)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddpkit import DdpkitError, DistEnv
from ddpkit.runtime import Collectives, Runtime, default_threads, resolve_backend, resolve_device_type
from ddpkit.runtime.store import bound_listener


def test_backend_follows_the_device_and_nccl_without_a_gpu_is_refused():
    assert resolve_backend("auto", "cuda") == "nccl" and resolve_backend("auto", "cpu") == "gloo"
    with pytest.raises(DdpkitError, match="--backend nccl needs a CUDA GPU"):
        resolve_backend("nccl", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_without_a_gpu_is_refused_and_auto_is_cpu():
    assert resolve_device_type("auto") == "cpu"
    with pytest.raises(DdpkitError, match="--device cuda was asked for but no CUDA GPU is visible"):
        resolve_device_type("cuda")


def test_threads_are_the_usable_cores_divided_among_local_processes():
    cores = len(os.sched_getaffinity(0))
    assert default_threads(1) == cores
    assert default_threads(cores * 4) == 1  # never 0


def test_the_store_listener_binds_one_address_and_names_a_port_in_use():
    sock = bound_listener("127.0.0.1", 0)
    try:
        host, port = sock.getsockname()
        assert host == "127.0.0.1"
        with pytest.raises(DdpkitError, match=f"cannot listen on the master address 127.0.0.1:{port}"):
            bound_listener("127.0.0.1", port).close()
    finally:
        sock.close()


def test_one_process_has_no_group_and_its_collectives_are_the_identity():
    with Runtime(DistEnv(), device="cpu", threads=1) as rt:
        assert not dist.is_initialized() and not rt.distributed and rt.is_main
        t = torch.tensor([1.5, 2.0])
        assert torch.equal(rt.all_sum(t), t) and rt.all_sum(t) is not t
        assert rt.all_gather_object({"a": 1}) == [{"a": 1}] and rt.broadcast_object(7) == 7


def test_a_collectives_tensor_goes_to_the_gpu_under_nccl_and_to_the_cpu_under_gloo():
    with Runtime(DistEnv(), device="cpu", threads=1) as rt:
        assert rt.backend == "gloo" and rt.collective_device == torch.device("cpu")
        rt.device = torch.device("cuda", 1)  # a GPU rank under gloo: gloo's small tensors stay on the CPU
        assert rt.collective_device == torch.device("cpu")
        rt.backend = "nccl"  # NCCL moves CUDA tensors only: this rank's GPU
        assert rt.collective_device == torch.device("cuda", 1)


class _Mapping:
    """Stands in for the job's shared-memory mapping: records what it was asked to sum."""

    def __init__(self, group):
        self.group = group
        self.calls = 0

    def all_reduce_small(self, t, op="sum"):
        self.calls += 1
        t.mul_(10)  # a mark the backend would not leave
        return True


def _two_ranks(rank, init_file, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        c = Collectives()
        plain = c.all_sum(torch.tensor([rank + 1.0]))  # no mapping: the backend sums
        c.use_shared_memory(_Mapping(dist.group.WORLD))
        through = c.all_sum(torch.tensor([rank + 1.0]))  # the mapping serves it
        c.use_shared_memory(_Mapping(object()))  # a mapping of another (gone) group: never used
        after = c.all_sum(torch.tensor([rank + 1.0]))
        out[rank] = (plain.item(), through.item(), after.item(), c.shm.calls)
    finally:
        dist.destroy_process_group()


def test_small_all_reduces_take_the_jobs_mapping_only_while_it_belongs_to_the_group(tmp_path):
    out = mp.Manager().dict()
    mp.spawn(_two_ranks, args=(str(tmp_path / "init"), out), nprocs=2, join=True)
    assert out[0] == (3.0, 10.0, 3.0, 0)  # 1 + 2 by gloo; rank 0's 1.0 marked by the mapping; gloo again
    assert out[1] == (3.0, 20.0, 3.0, 0)


def _record_of_the_runtime(rank, init_file, out):
    import ddpkit

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        env = DistEnv(rank=rank, world_size=2, local_rank=rank, local_world_size=2)
        with Runtime(env, device="cpu", threads=1) as rt:
            assert Runtime.active() is rt and rt.collectives.record is rt.record
            rt.all_sum(torch.ones(2))  # the loop's path
            total = ddpkit.all_sum(torch.tensor([rank + 1.0]))  # the public helper: the same record
            mapping = _Mapping(dist.group.WORLD)
            rt.collectives.use_shared_memory(mapping)
            assert mapping.record is rt.record  # its gradient buckets are recorded there too
            rt.collectives.all_reduce_(torch.zeros(1), op="max")
            plain = ddpkit.all_sum(torch.tensor([rank + 1.0]))  # never through the mapping
            entries = [(e.seq, e.op, list(e.shape), e.path, e.state) for e in rt.record]
        assert Runtime.active() is None
        after = ddpkit.all_sum(torch.tensor([1.0]))  # no Runtime: the process group alone, recorded nowhere
        out[rank] = (total.item(), plain.item(), after.item(), mapping.calls, entries, len(list(rt.record)))
    finally:
        dist.destroy_process_group()


def test_every_collective_of_a_runtime_lands_in_its_own_record(tmp_path):
    out = mp.Manager().dict()
    mp.spawn(_record_of_the_runtime, args=(str(tmp_path / "init"), out), nprocs=2, join=True)
    for rank in (0, 1):
        total, plain, after, calls, entries, kept = out[rank]
        assert (total, plain, after, calls) == (3.0, 3.0, 2.0, 1)
        assert entries == [
            (1, "all_reduce", [2], "backend", "done"),
            (2, "all_reduce", [1], "backend", "done"),
            (3, "all_reduce(max)", [1], "shm", "done"),
            (4, "all_reduce", [1], "backend", "done"),
        ]
        assert kept == 4  # the record outlives the group: closing it records nothing more


def test_the_active_runtime_is_the_one_open_and_each_has_its_own_record():
    with Runtime(DistEnv(), device="cpu", threads=1) as first:
        with Runtime(DistEnv(), device="cpu", threads=1) as second:
            assert Runtime.active() is second and second.record is not first.record
        assert Runtime.active() is None  # the newest one closed; the older one is not brought back
    first.close()
    assert Runtime.active() is None
