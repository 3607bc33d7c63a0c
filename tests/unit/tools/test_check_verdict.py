"""`ddpkit check`'s verdict, line for line, for reports as check.py gathers them: one recorded
on this machine (`ddpkit check --nproc 2 --json`, 2 ranks on one node), and that report
spread over two nodes with one thing broken at a time. The expected tables
(check_reports/verdicts.txt) were written by the judge before it became a list of checks: the
checks must say exactly what it said."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from ddpkit.tools.check_report import format_check, judge

HERE = Path(__file__).parent / "check_reports"


def recorded() -> dict:
    return json.loads((HERE / "one_node_2_ranks.json").read_text())


def two_nodes() -> dict:
    """The recorded report as 4 ranks on 2 nodes: ports probed, one node pair measured."""
    r = recorded()
    fact = r["facts"][0]
    r["facts"] = [{**copy.deepcopy(fact), "rank": i, "local_rank": i % 2, "node_rank": i // 2} for i in range(4)]
    for f in r["facts"]:
        f["host"], f["interface"], f["warnings"] = f"n{f['node_rank']}", "eth0", []
    r["run_dir"] = [{"error": None, "sees": [0, 1, 2, 3]} for _ in range(4)]
    r["clocks"] = [{"time": 100.0}, {"time": 100.001}, {"time": 100.002}, {"time": 100.0}]
    r["ports"] = [
        {"from": 0, "to": 2, "address": "10.0.0.2:4000", "ok": True},
        {"from": 2, "to": 0, "address": "10.0.0.1:4001", "ok": True},
    ]
    r["allreduce"]["pairs"] = [{"ranks": [0, 2], "latency_us": 200.0, "busbw_gbps": 1.5}]
    return r


def _versions(r: dict) -> None:
    for f in r["facts"][2:]:
        f["versions"]["torch"] = "2.12.0+cpu"
    r["facts"][3]["versions"]["ddpkit"] = "0.0.9"


def _backend(r: dict) -> None:
    r["facts"][3].update(backend="nccl", interface=None)


def _run_dir(r: dict) -> None:
    r["run_dir"][1]["error"] = "PermissionError: [Errno 13] Permission denied: '/home/user/runs/x'"
    for d in r["run_dir"][2:]:
        d["sees"] = [2, 3]


def _clocks_and_ports(r: dict) -> None:
    r["clocks"][3]["time"] = 102.5
    r["ports"][1].update(ok=False, error="ConnectionRefusedError: [Errno 111] Connection refused")


def _one_process(r: dict) -> None:
    r["facts"], r["run_dir"], r["clocks"], r["allreduce"] = r["facts"][:1], [{"error": None, "sees": [0]}], [], {}


def _memory_and_traps(r: dict) -> None:
    r["facts"][0]["shm_free_mib"] = 64
    for f in r["facts"][2:]:
        f.update(memory_available_gib=None, shm_free_mib=None, traps=["NCCL_P2P_DISABLE=1 is set"])
    r["facts"][3]["warnings"] = ["load average 9.00 on 2 cores"]


SCENARIOS = {
    "recorded": (recorded, None),
    "recorded, one process": (recorded, _one_process),
    "two nodes": (two_nodes, None),
    "versions differ": (two_nodes, _versions),
    "backends differ": (two_nodes, _backend),
    "run directory not shared": (two_nodes, _run_dir),
    "clocks apart, a port closed": (two_nodes, _clocks_and_ports),
    "all-reduce skipped": (two_nodes, lambda r: r.update(allreduce={"skipped": "the ranks run different versions"})),
    "all-reduce failed": (two_nodes, lambda r: r.update(allreduce={"error": "RuntimeError: Connection reset by peer"})),
    "memory low, traps": (two_nodes, _memory_and_traps),
    "several failures": (two_nodes, lambda r: [f(r) for f in (_versions, _backend, _clocks_and_ports, _run_dir)]),
}


def expected() -> dict[str, str]:
    """verdicts.txt: `### name` then the exact table `ddpkit check` prints for it."""
    out, name = {}, None
    for line in (HERE / "verdicts.txt").read_text().splitlines():
        if line.startswith("### "):
            name = line[4:]
            out[name] = []
        elif name is not None:
            out[name].append(line)
    return {k: "\n".join(v).rstrip("\n") for k, v in out.items()}


def report_of(name: str) -> dict:
    build, change = SCENARIOS[name]
    r = build()
    if change:
        change(r)
    return r


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_verdict_is_the_one_recorded(name):
    r = report_of(name)
    rows, ok = judge(r)
    text = format_check({**r, "rows": rows})
    assert text == expected()[name]
    assert ok == (" would NOT run " not in text)


def test_every_scenario_has_its_recorded_verdict():
    assert list(expected()) == list(SCENARIOS)
