"""The verdict of `ddpkit check`, from plain data: which checks pass, warn or fail, and the table rank 0 prints.

Kept apart from the probes (check.py), which need processes and a store, so that the rules a
report is judged by can be read and unit-tested on a dict alone.
"""

from __future__ import annotations

from typing import Any

CLOCK_WARN_S = 1.0


def judge(report: dict[str, Any]) -> tuple[list[tuple[str, str, str]], bool]:
    """Rows of (check, OK/WARN/FAIL, detail) and whether a job would run."""
    facts, rows = report["facts"], []
    world = len(facts)

    def node(r: int) -> str:
        f = facts[r]
        return f"{f['host']} (node {f['node_rank']})"

    # versions
    keys = ("python", "torch", "cuda", "nccl", "ddpkit")
    differ = []
    for k in keys:
        values: dict[Any, list[int]] = {}
        for f in facts:
            values.setdefault(f["versions"][k], []).append(f["rank"])
        if len(values) > 1:
            differ.append(f"{k} " + " vs ".join(f"{v} on {_ranks(rs, facts)}" for v, rs in values.items()))
    v0 = facts[0]["versions"]
    same = ", ".join(f"{k} {v0[k]}" for k in keys if v0[k])
    rows.append(
        ("versions", "FAIL" if differ else "OK", "; ".join(differ) if differ else f"same on all {world} ranks: {same}")
    )
    # backend and interface
    chosen = {(f["backend"], f["interface"]) for f in facts}
    backends = {f["backend"] for f in facts}
    detail = "; ".join(
        f"{b} via {i or '?'} on {_ranks([f['rank'] for f in facts if (f['backend'], f['interface']) == (b, i)], facts)}"
        for b, i in sorted(chosen, key=str)
    )
    rows.append(("backend", "FAIL" if len(backends) > 1 else "OK", detail))
    # run directory
    path = report.get("run_dir_path", "RUN_DIR")
    errors = [f"rank {r}: {d['error']}" for r, d in enumerate(report["run_dir"]) if d.get("error")]
    blind = [r for r, d in enumerate(report["run_dir"]) if len(d["sees"]) < world]
    if errors or blind:
        groups: dict[tuple[int, ...], list[int]] = {}
        for r, d in enumerate(report["run_dir"]):
            groups.setdefault(tuple(d["sees"]), []).append(r)
        parts = [
            f"{_ranks(rs, facts)} see{'s' if len(rs) == 1 else ''} the files of rank(s) {_span(list(seen))}"
            for seen, rs in groups.items()
        ]
        other = sorted({node(r) for r in blind if 0 not in report["run_dir"][r]["sees"]})
        rows.append(
            (
                "run directory",
                "FAIL",
                f"{path} is not one shared folder: "
                + "; ".join(errors + parts)
                + (
                    f" (a different folder on {', '.join(other)}: mount the shared file system there, or pass "
                    "--run-dir on it)"
                    if other
                    else ""
                ),
            )
        )
    else:
        rows.append(("run directory", "OK", f"{path}: every rank wrote a file there and read every other rank's"))
    # clocks
    times = [c["time"] for c in report["clocks"]]
    skew = max(times) - min(times) if times else 0.0
    rows.append(
        (
            "clocks",
            "WARN" if skew > CLOCK_WARN_S else "OK",
            f"spread {skew * 1e3:.0f} ms across ranks after a barrier"
            + (" (sync them: NTP/chrony; logs and time limits disagree)" if skew > CLOCK_WARN_S else ""),
        )
    )
    # ports between nodes
    ports = report.get("ports") or []
    closed = [p for p in ports if not p["ok"]]
    if not ports:
        rows.append(("ports", "OK", "one node: nothing crosses a network"))
    else:
        rows.append(
            (
                "ports",
                "FAIL" if closed else "OK",
                "; ".join(
                    f"{node(p['from'])} cannot connect to {p['address']} on {node(p['to'])}: {p.get('error')}"
                    for p in closed
                )
                if closed
                else f"every node reached a fresh TCP port on every other ({len(ports)} connections)",
            )
        )
    # all-reduce
    ar = report.get("allreduce") or {}
    if ar.get("skipped") or ar.get("error"):
        rows.append(("all-reduce", "FAIL", ar.get("error") or f"not run: {ar['skipped']}"))
    elif ar:
        a = ar["all"]
        rows.append(
            (
                "all-reduce",
                "OK",
                f"all {world} ranks: latency {a['latency_us']:.0f} us (4 B), bus bandwidth "
                f"{a['busbw_gbps']:.2f} GB/s (16 MiB)",
            )
        )
        for p in ar.get("pairs", []):
            a, b = p["ranks"]
            rows.append(
                (
                    "  node pair",
                    "OK",
                    f"{node(a)} <-> {node(b)}: latency {p['latency_us']:.0f} us, "
                    f"bus bandwidth {p['busbw_gbps']:.2f} GB/s",
                )
            )
    else:
        rows.append(("all-reduce", "OK", "one process: nothing to all-reduce"))
    # memory, /dev/shm, traps, ddpkit env's warnings: per node
    by_node: dict[str, dict[str, Any]] = {}
    for f in facts:
        by_node.setdefault(f"{f['host']} (node {f['node_rank']})", f)
    mem = []
    warn_mem = False
    for name, f in by_node.items():
        shm = f["shm_free_mib"]
        low = (f["memory_available_gib"] or 0) < 1 or (shm is not None and shm < 256)
        warn_mem |= low
        mem.append(f"{name}: {f['memory_available_gib']} GiB free, /dev/shm {shm} MiB free")
    rows.append(("memory", "WARN" if warn_mem else "OK", "; ".join(mem)))
    hints = sorted({f"{name}: {t}" for name, f in by_node.items() for t in f["traps"] + f["warnings"]})
    rows.append(
        (
            "traps",
            "WARN" if hints else "OK",
            "; ".join(hints) if hints else "none known (ddpkit env's checks, NCCL hints on GPU nodes)",
        )
    )
    ok = not any(status == "FAIL" for _, status, _ in rows)
    return rows, ok


def _ranks(ranks: list[int], facts: list[dict[str, Any]]) -> str:
    hosts = sorted({f"{facts[r]['host']}" for r in ranks})
    return f"rank{'s' if len(ranks) > 1 else ''} {_span(ranks)} ({', '.join(hosts)})"


def _span(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    if not ranks:
        return "none"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def format_check(report: dict[str, Any]) -> str:
    facts = report["facts"]
    nodes = len({(f["node_rank"], f["host"]) for f in facts})
    lines = [f"ddpkit check: {len(facts)} rank(s) on {nodes} node(s)"]
    width = max(len(r[0]) for r in report["rows"])
    for name, status, detail in report["rows"]:
        lines.append(f"  {name:<{width}}  {status:<4}  {detail}")
    failed = [name.strip() for name, status, _ in report["rows"] if status == "FAIL"]
    warned = [name.strip() for name, status, _ in report["rows"] if status == "WARN"]
    if failed:
        lines.append(f"verdict: a job would NOT run here: {', '.join(failed)} failed (see above)")
    else:
        lines.append("verdict: a job would run here" + (f" (warnings: {', '.join(warned)})" if warned else ""))
    return "\n".join(lines)
