"""DDPKIT_SHARE_GPU=1: several ranks of a node on one GPU, over gloo (runtime/devices.py), so
the multi-rank CUDA paths run on a machine with one GPU. The decision needs no GPU: it is made
from the counts, and checked here for every case; the runs themselves are scripts/gpu_check.sh's
step 11 (a GPU) and its CPU stand-in."""

import re

import pytest

from ddpkit import DdpkitError, DistEnv
from ddpkit.runtime.devices import (
    DeviceChoice,
    check_gpu_count,
    choose_devices,
    gpu_index_of,
    resolve_backend,
    share_gpu_opted,
)

ON = {"DDPKIT_SHARE_GPU": "1"}
OFF: dict[str, str] = {}


@pytest.mark.parametrize(
    "device, backend, procs, ngpu, environ, want",
    [
        ("cuda", "auto", 2, 1, ON, DeviceChoice("cuda", "gloo", shared=True)),  # 2 ranks, 1 GPU: gloo
        ("auto", "auto", 4, 1, ON, DeviceChoice("cuda", "gloo", shared=True)),
        ("cuda", "gloo", 2, 1, ON, DeviceChoice("cuda", "gloo", shared=True)),
        ("cuda", "auto", 2, 2, ON, DeviceChoice("cuda", "nccl")),  # a GPU each: nothing shared, NCCL as ever
        ("cuda", "auto", 1, 1, ON, DeviceChoice("cuda", "nccl")),
        ("cuda", "auto", 2, 2, OFF, DeviceChoice("cuda", "nccl")),
        ("cpu", "auto", 2, 1, ON, DeviceChoice("cpu", "gloo")),  # CPU ranks: the opt-in is about GPUs only
        ("auto", "auto", 2, 0, ON, DeviceChoice("cpu", "gloo")),
    ],
)
def test_the_device_and_backend_each_rank_takes(device, backend, procs, ngpu, environ, want):
    assert choose_devices(device, backend, procs, ngpu, environ) == want


def test_nccl_is_refused_where_ranks_share_a_gpu_and_cuda_without_a_gpu_as_before():
    with pytest.raises(DdpkitError, match=re.escape("--backend nccl with DDPKIT_SHARE_GPU=1: NCCL refuses two ranks")):
        choose_devices("cuda", "nccl", 2, 1, ON)
    with pytest.raises(DdpkitError, match="--device cuda was asked for but no CUDA GPU is visible"):
        choose_devices("cuda", "auto", 2, 0, ON)
    with pytest.raises(DdpkitError, match="--backend nccl needs a CUDA GPU"):
        resolve_backend("nccl", "cpu")


def test_more_processes_than_gpus_need_the_opt_in_which_the_refusal_names():
    with pytest.raises(DdpkitError) as refused:
        check_gpu_count(2, 1, OFF)
    message = str(refused.value)
    assert message.startswith("--nproc 2 but only 1 GPU(s) are visible: use at most one process per GPU (--nproc 1)")
    assert "DDPKIT_SHARE_GPU=1 lets ranks share them over gloo" in message
    check_gpu_count(2, 1, ON)  # opted in: accepted
    check_gpu_count(1, 1, OFF)
    with pytest.raises(
        DdpkitError, match=r"only 0 GPU\(s\) are visible: use at most one process per GPU \(--nproc 0\)$"
    ):
        check_gpu_count(2, 0, ON)  # nothing to share


def test_the_opt_in_is_1_and_anything_else_but_0_is_a_mistake():
    assert share_gpu_opted({"DDPKIT_SHARE_GPU": "1"}) and not share_gpu_opted({"DDPKIT_SHARE_GPU": "0"})
    assert not share_gpu_opted({})
    with pytest.raises(DdpkitError, match=re.escape("DDPKIT_SHARE_GPU='yes': set it to 1")):
        share_gpu_opted({"DDPKIT_SHARE_GPU": "yes"})


def test_sharing_ranks_take_the_gpus_in_turn():
    env = lambda local: DistEnv(rank=local, local_rank=local, world_size=3, local_world_size=3)  # noqa: E731
    assert [gpu_index_of(env(i), 1, shared=True) for i in range(3)] == [0, 0, 0]
    assert [gpu_index_of(env(i), 2, shared=True) for i in range(3)] == [0, 1, 0]
    assert gpu_index_of(env(1), 1, shared=False) is None  # without the opt-in: local rank 1 has no GPU
