"""The verdict of `ddpkit check`, from plain data: which checks pass, warn or fail, and the table rank 0 prints.

Kept apart from the probes (check.py), which need processes and a store, so that the rules a
report is judged by can be read and unit-tested on a dict alone. The verdict is CHECKS: small
functions, each reading the gathered report and returning its rows; a new check is one more
function in that tuple. format_check writes the table.
"""

from __future__ import annotations

from typing import Any, Callable

CLOCK_WARN_S = 1.0

Row = tuple[str, str, str]  # (check, OK/WARN/FAIL, detail)


def judge(report: dict[str, Any]) -> tuple[list[Row], bool]:
    """Rows of (check, OK/WARN/FAIL, detail), every check's in CHECKS order, and whether a job would run."""
    rows = [row for check in CHECKS for row in check(report)]
    return rows, not any(status == "FAIL" for _, status, _ in rows)


def versions(report: dict[str, Any]) -> list[Row]:
    """Every rank runs the same python, torch, CUDA, NCCL and ddpkit."""
    facts, keys = report["facts"], ("python", "torch", "cuda", "nccl", "ddpkit")
    differ = []
    for k in keys:
        values: dict[Any, list[int]] = {}
        for f in facts:
            values.setdefault(f["versions"][k], []).append(f["rank"])
        if len(values) > 1:
            differ.append(f"{k} " + " vs ".join(f"{v} on {_ranks(rs, facts)}" for v, rs in values.items()))
    if differ:
        return [("versions", "FAIL", "; ".join(differ))]
    v0 = facts[0]["versions"]
    same = ", ".join(f"{k} {v0[k]}" for k in keys if v0[k])
    return [("versions", "OK", f"same on all {len(facts)} ranks: {same}")]


def backend(report: dict[str, Any]) -> list[Row]:
    """Every rank chose the same backend (each names its interface)."""
    facts = report["facts"]
    chosen = {(f["backend"], f["interface"]) for f in facts}
    detail = "; ".join(
        f"{b} via {i or '?'} on {_ranks([f['rank'] for f in facts if (f['backend'], f['interface']) == (b, i)], facts)}"
        for b, i in sorted(chosen, key=str)
    )
    return [("backend", "FAIL" if len({f["backend"] for f in facts}) > 1 else "OK", detail)]


def run_directory(report: dict[str, Any]) -> list[Row]:
    """Every rank wrote its file into the run directory and read every other rank's: one shared folder."""
    facts, dirs = report["facts"], report["run_dir"]
    path = report.get("run_dir_path", "RUN_DIR")
    errors = [f"rank {r}: {d['error']}" for r, d in enumerate(dirs) if d.get("error")]
    blind = [r for r, d in enumerate(dirs) if len(d["sees"]) < len(facts)]
    if not errors and not blind:
        if "://" in path:
            return [("run directory", "OK", f"{path}: every rank reached the bucket and wrote a test object there")]
        return [("run directory", "OK", f"{path}: every rank wrote a file there and read every other rank's")]
    if "://" in path:
        return [("run directory", "FAIL", "; ".join(errors))]
    groups: dict[tuple[int, ...], list[int]] = {}
    for r, d in enumerate(dirs):
        groups.setdefault(tuple(d["sees"]), []).append(r)
    parts = [
        f"{_ranks(rs, facts)} see{'s' if len(rs) == 1 else ''} the files of rank(s) {_span(list(seen))}"
        for seen, rs in groups.items()
    ]
    other = sorted({_node(facts, r) for r in blind if 0 not in dirs[r]["sees"]})
    where = (
        f" (a different folder on {', '.join(other)}: mount the shared file system there, or pass --run-dir on it)"
        if other
        else ""
    )
    return [("run directory", "FAIL", f"{path} is not one shared folder: " + "; ".join(errors + parts) + where)]


def clocks(report: dict[str, Any]) -> list[Row]:
    """The ranks' clocks read after one barrier agree within CLOCK_WARN_S (a warning: jobs still run)."""
    times = [c["time"] for c in report["clocks"]]
    skew = max(times) - min(times) if times else 0.0
    far = skew > CLOCK_WARN_S
    detail = f"spread {skew * 1e3:.0f} ms across ranks after a barrier" + (
        " (sync them: NTP/chrony; logs and time limits disagree)" if far else ""
    )
    return [("clocks", "WARN" if far else "OK", detail)]


def ports(report: dict[str, Any]) -> list[Row]:
    """Every node reached a fresh TCP port on every other node."""
    facts, probed = report["facts"], report.get("ports") or []
    if not probed:
        return [("ports", "OK", "one node: nothing crosses a network")]
    closed = [p for p in probed if not p["ok"]]
    if not closed:
        return [("ports", "OK", f"every node reached a fresh TCP port on every other ({len(probed)} connections)")]
    detail = "; ".join(
        f"{_node(facts, p['from'])} cannot connect to {p['address']} on {_node(facts, p['to'])}: {p.get('error')}"
        for p in closed
    )
    return [("ports", "FAIL", detail)]


def allreduce(report: dict[str, Any]) -> list[Row]:
    """The all-reduce over every rank ran (its latency and bandwidth), then one row per node pair measured."""
    facts, ar = report["facts"], report.get("allreduce") or {}
    if ar.get("skipped") or ar.get("error"):
        return [("all-reduce", "FAIL", ar.get("error") or f"not run: {ar['skipped']}")]
    if not ar:
        return [("all-reduce", "OK", "one process: nothing to all-reduce")]
    a = ar["all"]
    rows = [
        (
            "all-reduce",
            "OK",
            f"all {len(facts)} ranks: latency {a['latency_us']:.0f} us (4 B), bus bandwidth "
            f"{a['busbw_gbps']:.2f} GB/s (16 MiB)",
        )
    ]
    for p in ar.get("pairs", []):
        x, y = p["ranks"]
        rows.append(
            (
                "  node pair",
                "OK",
                f"{_node(facts, x)} <-> {_node(facts, y)}: latency {p['latency_us']:.0f} us, "
                f"bus bandwidth {p['busbw_gbps']:.2f} GB/s",
            )
        )
    return rows


def memory(report: dict[str, Any]) -> list[Row]:
    """Each node's free memory and /dev/shm (a warning under 1 GiB or 256 MiB)."""
    warn, parts = False, []
    for name, f in _by_node(report["facts"]).items():
        shm = f["shm_free_mib"]
        warn |= (f["memory_available_gib"] or 0) < 1 or (shm is not None and shm < 256)
        parts.append(f"{name}: {f['memory_available_gib']} GiB free, /dev/shm {shm} MiB free")
    return [("memory", "WARN" if warn else "OK", "; ".join(parts))]


def traps(report: dict[str, Any]) -> list[Row]:
    """Each node's known traps and `ddpkit env`'s warnings (warnings: jobs still run)."""
    hints = sorted(
        {f"{name}: {t}" for name, f in _by_node(report["facts"]).items() for t in f["traps"] + f["warnings"]}
    )
    if not hints:
        return [("traps", "OK", "none known (ddpkit env's checks, NCCL hints on GPU nodes)")]
    return [("traps", "WARN", "; ".join(hints))]


# the checks, in the order of the table; each reads the gathered report and returns its rows
CHECKS: tuple[Callable[[dict[str, Any]], list[Row]], ...] = (
    versions,
    backend,
    run_directory,
    clocks,
    ports,
    allreduce,
    memory,
    traps,
)


def _node(facts: list[dict[str, Any]], rank: int) -> str:
    return _where(facts[rank])


def _where(f: dict[str, Any]) -> str:
    return f"{f['host']} (node {f['node_rank']})"


def _by_node(facts: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The first rank's facts of each node (the per-node facts are alike on its ranks)."""
    out: dict[str, dict[str, Any]] = {}
    for f in facts:
        out.setdefault(_where(f), f)
    return out


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
