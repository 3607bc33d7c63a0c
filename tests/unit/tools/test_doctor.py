"""`ddpkit env`: the launcher it detects, the ranks it resolves, the traps it warns about."""

import json
import os
import socket
import stat

import pytest

from conftest import run_ddpkit
from ddpkit.tools import doctor

SLURM_2_NODES = {
    "SLURM_JOB_ID": "42",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_NTASKS": "2",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
}


@pytest.fixture
def fake_scontrol(tmp_path, monkeypatch):
    """`scontrol show hostnames` as on a cluster (names that resolve here, so no DNS is asked)."""
    exe = tmp_path / "scontrol"
    exe.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames node[1-2]" ] && printf "localhost\\nnode2\\n"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")


def test_no_launcher_means_ddpkit_starts_the_workers():
    r = doctor.collect({"PATH": os.environ["PATH"]})
    assert r["launcher"]["name"] == "none"
    assert r["launcher"]["resolved"]["world_size"] == 1
    assert r["network"]["master_addr"] == "127.0.0.1"
    assert r["plan"]["device"] == "cpu" and r["plan"]["backend"] == "gloo" and r["plan"]["processes_per_node"] == 2
    assert r["plan"]["grad_sync"] == "shm" and r["plan"]["shm_free_mib"] > 0  # CPU ranks on one machine
    assert "sum gradients in shared memory" in doctor.format_report(r)
    assert r["versions"]["gloo"] is True and r["versions"]["torch"]
    assert not any("srun" in w for w in r["warnings"])


def test_a_torchrun_job_is_resolved_from_its_variables():
    env = {
        "LOCAL_RANK": "1",
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }
    r = doctor.collect(env)
    assert r["launcher"]["name"] == "torchrun" and r["launcher"]["nnodes"] == 2
    assert {k: r["launcher"]["resolved"][k] for k in ("rank", "local_rank", "node_rank", "world_size")} == {
        "rank": 3,
        "local_rank": 1,
        "node_rank": 1,
        "world_size": 4,
    }
    assert r["network"]["master_addr"] == "127.0.0.1" and r["network"]["master_port"] == "29500"
    assert "rank 3 of 4" in r["plan"]["how"]
    assert r["plan"]["grad_sync"] == "gloo" and "several machines" in r["plan"]["grad_sync_why"]
    # a multi-node job whose master is loopback cannot work: said so
    assert any("master address 127.0.0.1 on a multi-node job" in w for w in r["warnings"])


def test_a_multi_node_slurm_allocation_without_srun_is_a_warning(fake_scontrol):
    r = doctor.collect(dict(SLURM_2_NODES, PATH=os.environ["PATH"]))
    s = r["launcher"]["slurm"]
    assert r["launcher"]["name"] == "slurm" and s["nodes"] == 2 and not s["in_srun_step"]
    assert s["hosts"] == ["localhost", "node2"]  # expanded by scontrol
    assert r["network"]["master_addr"] == "localhost"  # the first node
    assert any("first node only" in w and "srun --kill-on-bad-exit=1 ddpkit train" in w for w in r["warnings"])
    text = doctor.format_report(r)
    assert "slurm job   42: 2 node(s) localhost node2" in text and "not inside an srun step" in text
    # inside `srun`, the same allocation is fine: this task is rank 0 of 2, its master the first node
    r = doctor.collect(dict(SLURM_2_NODES, SLURM_STEP_ID="0", PATH=os.environ["PATH"]))
    assert r["launcher"]["slurm"]["in_srun_step"] and not any("first node only" in w for w in r["warnings"])
    assert r["launcher"]["resolved"]["world_size"] == 2 and r["launcher"]["resolved"]["launcher"] == "slurm"
    assert r["plan"]["how"].startswith("this process is rank 0 of 2 in a job started by slurm")


def test_without_scontrol_ddpkit_expands_the_node_list_itself_and_shows_what_it_cannot_read(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol
    r = doctor.collect(dict(SLURM_2_NODES, SLURM_STEP_ID="batch", SLURM_JOB_NODELIST="127.0.0.[1-2]"))
    assert r["launcher"]["slurm"]["hosts"] == ["127.0.0.1", "127.0.0.2"] and not r["launcher"]["slurm"]["in_srun_step"]
    r = doctor.collect(dict(SLURM_2_NODES, SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="node[1-"))
    assert r["launcher"]["slurm"]["hosts"] == [] and "node[1-" in doctor.format_report(r)


def test_gpus_hidden_by_cuda_visible_devices_and_thread_oversubscription(monkeypatch):
    import torch

    import ddpkit.runtime

    monkeypatch.setattr(doctor.glob, "glob", lambda pattern: ["/dev/nvidia0", "/dev/nvidia1"])
    # the GPUs are hidden and torch is a CPU build, whatever this machine has (a CUDA build of torch,
    # as on a GPU machine, sees its real GPUs and does not get the CPU-build warning)
    monkeypatch.setattr(ddpkit.runtime, "cuda_device_count", lambda: 0)
    monkeypatch.setattr(torch.version, "cuda", None)
    from ddpkit.runtime import usable_cores

    cores = usable_cores()  # every process taking all of them: 2 processes oversubscribe, whatever the machine
    r = doctor.collect({"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(cores)})
    assert r["devices"]["cpu_cores_usable"] == cores
    assert any("CUDA_VISIBLE_DEVICES='' hides 2 of this machine's 2 GPUs" in w for w in r["warnings"])
    assert any(f"OMP_NUM_THREADS={cores} x 2 processes > {cores} usable cores" in w for w in r["warnings"])
    if cores >= 2:  # cores / processes threads each: no warning (with 1 core, 2 processes always oversubscribe)
        r = doctor.collect({"OMP_NUM_THREADS": str(cores // 2)})
        assert not any("OMP_NUM_THREADS" in w for w in r["warnings"])
    r = doctor.collect({})
    assert any("torch is a CPU build" in w for w in r["warnings"])


def test_a_torch_without_compiled_copies_under_pythondontwritebytecode_is_a_warning(monkeypatch):
    monkeypatch.setattr(doctor, "_bytecode_cached", lambda source: False)
    warned = [w for w in doctor.collect({"PYTHONDONTWRITEBYTECODE": "1"})["warnings"] if "PYTHONDONTWRITEBYTECODE" in w]
    assert warned and "compiles torch's modules again" in warned[0]
    assert not any("PYTHONDONTWRITEBYTECODE" in w for w in doctor.collect({})["warnings"])  # Python writes them
    monkeypatch.setattr(doctor, "_bytecode_cached", lambda source: True)
    assert not any("PYTHONDONTWRITEBYTECODE" in w for w in doctor.collect({"PYTHONDONTWRITEBYTECODE": "1"})["warnings"])


def test_the_bytecode_check_reads_the_cache_next_to_a_module(tmp_path):
    import py_compile

    module = tmp_path / "m.py"
    module.write_text("x = 1\n")
    assert not doctor._bytecode_cached(str(module))
    py_compile.compile(str(module), doraise=True)
    assert doctor._bytecode_cached(str(module))


def test_ddpkit_env_inside_a_job_reports_its_rank_without_meeting_the_other_ranks():
    """Rank 1 of 2, and at the master's address a socket that takes connections but never
    answers: a process group (its store) would connect there and wait (the subprocess timeout
    ends that as a failure). ddpkit env must report and not even connect."""
    with socket.socket() as master:
        master.bind(("127.0.0.1", 0))
        master.listen(8)
        env = {
            "RANK": "1",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(master.getsockname()[1]),
        }
        proc = run_ddpkit("env", "--json", env=env, timeout=60)
        master.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing in the accept queue: nobody connected
            master.accept()
    r = json.loads(proc.stdout)
    assert r["launcher"]["resolved"]["rank"] == 1 and r["launcher"]["resolved"]["world_size"] == 2
    text = run_ddpkit("env", timeout=60).stdout
    for section in ("versions", "devices", "launcher", "network", "ddpkit train would", "warnings"):
        assert f"\n{section}" in f"\n{text}"
    assert "torch       2." in text and "gloo        available" in text
