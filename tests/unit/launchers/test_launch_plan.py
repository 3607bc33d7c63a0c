"""From a RunConfig to a LaunchPlan (launchers/plan.py): the pieces that need no network."""

import pytest

from ddpkit import DdpkitError, RunConfig
from ddpkit.launchers.plan import describe, make_launch_plan, resolve_nproc


def test_one_node_meets_through_private_files_not_a_port():
    plan = make_launch_plan(RunConfig(nproc=3, max_restarts=2, timeout=12), 3, "cpu", True, 1)
    assert (plan.nproc_per_node, plan.rdzv_backend, plan.rdzv_endpoint, plan.local_addr, plan.local) == (
        3,
        "c10d",
        "",
        "127.0.0.1",
        True,
    )
    assert (plan.max_restarts, plan.timeout, plan.start_method) == (2, 12, "fork")
    text = describe(plan, "gloo", "cpu")
    assert "world size         3" in text and "rendezvous         c10d, this node only (a file store" in text
    assert not make_launch_plan(RunConfig(nnodes="1:2", rdzv_endpoint="127.0.0.1:29400"), 2, "cpu", True, 1).local


def test_gpu_runs_spawn_and_a_parent_that_touched_torch_never_forks():
    assert make_launch_plan(RunConfig(), 2, "cuda", True, 1).start_method == "spawn"
    assert make_launch_plan(RunConfig(), 2, "cpu", False, 1).start_method == "spawn"


def test_nodes_of_one_job_derive_the_same_rendezvous_id():
    a = make_launch_plan(RunConfig(nnodes="2", master_addr="127.0.0.1", node_rank=0), 2, "cpu", True, 1)
    b = make_launch_plan(RunConfig(nnodes="2", master_addr="127.0.0.1", node_rank=1), 2, "cpu", True, 1)
    assert a.rdzv_id == b.rdzv_id and a.rdzv_backend == "static" and (a.node_rank, b.node_rank) == (0, 1)


def test_nproc_auto_is_two_cpu_processes():
    assert resolve_nproc(None, "cpu") == 2 and resolve_nproc(5, "cpu") == 5


def test_more_processes_than_gpus_is_refused(monkeypatch):
    import ddpkit.launchers.plan as plan

    monkeypatch.setattr(plan, "cuda_device_count", lambda: 2)
    assert resolve_nproc(None, "cuda") == 2
    with pytest.raises(DdpkitError, match="--nproc 3 but only 2 GPU"):
        resolve_nproc(3, "cuda")


def test_more_processes_than_the_machine_can_start_is_one_line_before_anything_starts(monkeypatch):
    import resource

    with pytest.raises(DdpkitError, match=r"--nproc 100000: .* open files per process .* at most [\d,]+ processes"):
        make_launch_plan(RunConfig(nproc=100000), 100000, "cpu", True, 1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        with pytest.raises(DdpkitError, match="allows 256 \\(ulimit -n\\): at most 64 processes"):
            make_launch_plan(RunConfig(nproc=100), 100, "cpu", True, 1)
        assert make_launch_plan(RunConfig(nproc=32), 32, "cpu", True, 1).nproc_per_node == 32
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
