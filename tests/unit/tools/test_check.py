"""ddpkit check's verdict from facts written by hand: each broken thing is named, and fails the check."""

import copy

from ddpkit.tools.check import gpu_traps
from ddpkit.tools.check_report import format_check, judge


def fact(rank, host, node, torch="2.13.0+cpu"):
    return {
        "rank": rank,
        "local_rank": rank % 2,
        "node_rank": node,
        "host": host,
        "backend": "gloo",
        "interface": "veth0",
        "versions": {"python": "3.11.7", "torch": torch, "cuda": None, "nccl": None, "ddpkit": "0.1.0"},
        "memory_available_gib": 20.0,
        "shm_free_mib": 4096,
        "gpus": 0,
        "traps": [],
        "warnings": [],
    }


def healthy():
    facts = [fact(0, "n0", 0), fact(1, "n0", 0), fact(2, "n1", 1), fact(3, "n1", 1)]
    return {
        "facts": facts,
        "run_dir_path": "/shared/run",
        "run_dir": [{"error": None, "sees": [0, 1, 2, 3]}] * 4,
        "clocks": [{"time": 100.0}, {"time": 100.001}, {"time": 100.002}, {"time": 100.0}],
        "ports": [
            {"from": 0, "to": 2, "address": "10.0.0.2:4000", "ok": True},
            {"from": 2, "to": 0, "address": "10.0.0.1:4001", "ok": True},
        ],
        "allreduce": {
            "all": {"latency_us": 300.0, "busbw_gbps": 1.2},
            "pairs": [{"ranks": [0, 2], "latency_us": 200.0, "busbw_gbps": 1.5}],
        },
    }


def status(rows, name):
    return next((s, d) for n, s, d in rows if n.strip() == name)


def test_a_healthy_allocation_passes_with_one_row_per_check():
    rows, ok = judge(healthy())
    assert ok
    text = format_check({**healthy(), "rows": rows})
    assert text.splitlines()[0] == "ddpkit check: 4 rank(s) on 2 node(s)"
    assert "n0 (node 0) <-> n1 (node 1): latency 200 us" in text
    assert text.splitlines()[-1] == "verdict: a job would run here"


def test_another_torch_on_one_node_fails_and_is_named():
    r = healthy()
    for f in r["facts"][2:]:
        f["versions"]["torch"] = "2.12.0+cpu"
    rows, ok = judge(r)
    assert not ok
    s, d = status(rows, "versions")
    assert s == "FAIL" and d == "torch 2.13.0+cpu on ranks 0,1 (n0) vs 2.12.0+cpu on ranks 2,3 (n1)"
    assert format_check({**r, "rows": rows}).endswith("verdict: a job would NOT run here: versions failed (see above)")


def test_a_node_whose_run_directory_is_another_folder_fails_and_is_named():
    r = healthy()
    r["run_dir"] = [{"error": None, "sees": [0, 1]}] * 2 + [{"error": None, "sees": [2, 3]}] * 2
    rows, ok = judge(r)
    s, d = status(rows, "run directory")
    assert not ok and s == "FAIL"
    assert "is not one shared folder" in d and "ranks 2,3 (n1) see the files of rank(s) 2,3" in d
    assert "a different folder on n1 (node 1)" in d


def test_closed_ports_fail_clock_spread_warns():
    r = healthy()
    r["ports"][1] = {"from": 2, "to": 0, "address": "10.0.0.1:4001", "ok": False, "error": "Connection refused"}
    r["clocks"][3] = {"time": 105.0}
    rows, ok = judge(copy.deepcopy(r))
    assert (
        not ok and status(rows, "ports")[0] == "FAIL" and "cannot connect to 10.0.0.1:4001" in status(rows, "ports")[1]
    )
    assert status(rows, "clocks")[0] == "WARN"


def test_gpu_node_hints():
    assert gpu_traps("nccl", 0, {}) == []
    hints = gpu_traps("nccl", 8, {"NCCL_P2P_DISABLE": "1"})
    assert any("NCCL_P2P_DISABLE=1" in h for h in hints) and any("NCCL_SOCKET_IFNAME is not set" in h for h in hints)


def test_warnings_do_not_fail_the_verdict_and_are_listed_in_it():
    r = healthy()
    r["facts"][2]["shm_free_mib"] = 64  # n1's /dev/shm nearly full
    r["facts"][0]["traps"] = ["load average 3.27 on 2 cores"]
    rows, ok = judge(r)
    assert ok
    assert status(rows, "memory") == (
        "WARN",
        "n0 (node 0): 20.0 GiB free, /dev/shm 4096 MiB free; n1 (node 1): 20.0 GiB free, /dev/shm 64 MiB free",
    )
    assert status(rows, "traps") == ("WARN", "n0 (node 0): load average 3.27 on 2 cores")
    verdict = format_check({**r, "rows": rows}).splitlines()[-1]
    assert verdict == "verdict: a job would run here (warnings: memory, traps)"


def test_mixed_backends_and_a_failed_all_reduce_fail_and_every_failure_is_in_the_verdict():
    r = healthy()
    r["facts"][3]["backend"] = "nccl"
    r["allreduce"] = {"error": "timed out after 60 s"}
    rows, ok = judge(r)
    assert not ok
    assert status(rows, "backend") == ("FAIL", "gloo via veth0 on ranks 0-2 (n0, n1); nccl via veth0 on rank 3 (n1)")
    assert status(rows, "all-reduce") == ("FAIL", "timed out after 60 s")
    assert format_check({**r, "rows": rows}).splitlines()[-1] == (
        "verdict: a job would NOT run here: backend, all-reduce failed (see above)"
    )


def test_one_process_on_one_node_has_nothing_to_cross_and_passes():
    one = {
        "facts": [fact(0, "n0", 0)],
        "run_dir_path": "/r",
        "run_dir": [{"error": None, "sees": [0]}],
        "clocks": [{"time": 1.0}],
        "ports": [],
        "allreduce": {},
    }
    rows, ok = judge(one)
    assert ok and [s for _, s, _ in rows] == ["OK"] * len(rows)
    assert status(rows, "ports") == ("OK", "one node: nothing crosses a network")
    assert status(rows, "all-reduce") == ("OK", "one process: nothing to all-reduce")
    assert format_check({**one, "rows": rows}).splitlines()[0] == "ddpkit check: 1 rank(s) on 1 node(s)"


def test_a_rank_that_cannot_write_the_run_directory_fails_with_its_error():
    r = healthy()
    r["run_dir"] = [{"error": None, "sees": [0, 1, 2]}] * 3 + [{"error": "Permission denied", "sees": []}]
    rows, ok = judge(r)
    s, d = status(rows, "run directory")
    assert not ok and s == "FAIL" and d.startswith("/shared/run is not one shared folder: rank 3: Permission denied")


def test_facts_gather_on_rank_0_and_its_verdict_reaches_every_rank():
    """Through a real store, ranks in threads: rank 0 alone reads every rank's value (the others
    get None, not world reads each), and rank 0's value is what every rank's share returns."""
    import threading

    import torch.distributed as dist

    from ddpkit.tools.check import barrier, gather, share

    store, world, got = dist.HashStore(), 4, {}

    def rank(r):
        barrier(store, "k/in", r, world)
        got[r] = (gather(store, "k/facts", r, world, {"rank": r}), share(store, "k/v", r, f"from {r}"))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert got[0][0] == [{"rank": r} for r in range(world)]
    assert all(got[r][0] is None for r in range(1, world))
    assert all(got[r][1] == "from 0" for r in range(world))


def test_every_node_reaches_every_other_nodes_port_even_when_some_finish_early():
    """Through a real store, node leaders in threads (each its own listener on this machine):
    a leader that has tried all its peers keeps its port open until every leader has tried
    it; closing at once refused the slower leaders' connections."""
    import threading

    import torch.distributed as dist

    from ddpkit.tools.check import port_probe

    store, leaders, got = dist.HashStore(), 8, {}

    def leader(r):
        got[r] = port_probe(store, "k", r, leaders, list(range(leaders)), "127.0.0.1")

    threads = [threading.Thread(target=leader, args=(r,)) for r in range(leaders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    ports = got[0]
    assert sorted((p["from"], p["to"]) for p in ports) == [
        (a, b) for a in range(leaders) for b in range(leaders) if a != b
    ]
    assert [p for p in ports if not p["ok"]] == []


def test_another_users_processes_on_the_machine_are_a_warning():
    import os
    import shutil
    import subprocess
    import time

    import pytest

    from ddpkit.tools.check import other_users, shared_machine_traps

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a process as another user")
    assert 4242 not in other_users()
    other = subprocess.Popen(["setpriv", "--reuid=4242", "--regid=4242", "--clear-groups", "sleep", "30"])
    try:
        deadline = time.monotonic() + 10
        while 4242 not in other_users() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert 4242 in other_users()
        (warning,) = shared_machine_traps()
        assert "4242" in warning and "no authentication" in warning
    finally:
        other.kill()
        other.wait()
