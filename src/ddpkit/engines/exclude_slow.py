"""`ddpkit slurm --exclude-slow`: at ddpkit's requeue, which nodes the requeued job leaves out.

The batch script runs this module on the batch host after the workers stopped for a requeue
(`python -m ddpkit.engines.exclude_slow RECORD JOB NODES`), before `scontrol requeue`: it prints
the job's new ExcNodeList (nothing: leave it as it is) and says on stderr, in the job log, which
node it leaves out and why, or why not. The script sets it with `scontrol update` right after the
requeue (SLURM changes ExcNodeList only of a job that is not running; the requeued job cannot start
again before the batch script has ended).

A node is left out when the straggler view named it at each of the last MIN_CHECKS checks of the
run (reporting/slow_nodes.py), but never so many that the job's partition keeps fewer usable
nodes than the job needs: SLURM would keep the job pending for ever. Usable: the partition's
nodes that SLURM does not hold out of service (down, drained or draining, failing, not
responding), counting those the job runs on. The longest streaks go first; a node that would
leave too few stays in, and the log says so. When SLURM cannot be asked, nothing is left out.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

from ..environments.slurm import hostnames
from ..errors import DdpkitError
from ..reporting.slow_nodes import MIN_CHECKS, SlowNodes

# node states (sinfo %T, without the flag suffixes) in which a node takes no new job
OUT_OF_SERVICE = ("down", "drain", "drained", "draining", "fail", "failing", "maint", "inval", "future", "unknown")


@dataclass
class Decision:
    leave_out: list[str] = field(default_factory=list)  # the nodes left out now
    exc_node_list: str = ""  # the job's new ExcNodeList ("": unchanged)
    lines: list[str] = field(default_factory=list)  # for the job log


def decide(record: SlowNodes, excluded: set[str], usable: dict[str, set[str]] | None, needed: int) -> Decision:
    """Which of the nodes `record` names slow to leave out of a job that needs `needed` nodes,
    already excludes `excluded`, and may run in the partitions of `usable` (each one's usable nodes;
    None: unknown, so none is left out)."""
    out = Decision()
    slow = [n for n in record.slow(MIN_CHECKS) if n not in excluded]
    if not slow:
        return out
    if usable is None:
        out.lines = [f"ddpkit: not leaving out {', '.join(slow)}: SLURM did not say which nodes the job may use"]
        return out
    keep = set(excluded)
    for name in slow:
        why = f"named slow at the last {record.streak(name)} straggler checks in a row ({record.why(name)})"
        room = {p: sorted(nodes - keep - {name}) for p, nodes in usable.items()}
        best = max(room, key=lambda p: len(room[p]), default=None)
        if best is None or len(room[best]) < needed:
            where = ", ".join(f"{p}: {', '.join(nodes) or 'none'}" for p, nodes in sorted(room.items()))
            out.lines.append(
                f"ddpkit: node {name} stays in the job though {why}: without it the job's partition keeps "
                f"fewer usable nodes than the {needed} it needs ({where or 'no partition'})"
            )
            continue
        keep.add(name)
        out.leave_out.append(name)
        out.lines.append(f"ddpkit: the requeued job leaves out node {name}: {why}")
    if out.leave_out:
        out.exc_node_list = ",".join(sorted(keep))
    return out


def job_fields(job: str) -> dict[str, str]:
    """`scontrol show job -o JOB` as a dict."""
    out = _run(["scontrol", "show", "job", "-o", job])
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def usable_nodes(partitions: list[str]) -> dict[str, set[str]]:
    """Each partition's nodes that are in service (sinfo -N)."""
    usable: dict[str, set[str]] = {}
    for partition in partitions:
        nodes = usable.setdefault(partition, set())
        for line in _run(["sinfo", "-h", "-N", "-p", partition, "-o", "%N %T"]).splitlines():
            name, _, state = line.partition(" ")
            if name and in_service(state.strip()):
                nodes.add(name)
    return usable


def in_service(state: str) -> bool:
    """A node state of sinfo's %T ("idle", "allocated", "drained", "idle*" not responding, "mixed~"
    powered down, ...) in which SLURM may start a job on it."""
    if "*" in state:
        return False
    return not any(part in OUT_OF_SERVICE for part in state.rstrip("~#!%$@^-").lower().split("+"))


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DdpkitError(f"{' '.join(argv)}: {e}") from None
    if done.returncode != 0:
        raise DdpkitError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def plan(record_path: str, job: str, needed: int) -> Decision:
    """The decision for this job from SLURM's view of it and its partitions."""
    record = SlowNodes.load(record_path)
    if not record.slow(MIN_CHECKS):
        return Decision()
    fields = job_fields(job)
    excluded = fields.get("ExcNodeList", "")
    excluded_now = set(hostnames(excluded)) if excluded not in ("", "(null)") else set()
    try:
        usable = usable_nodes([p for p in fields.get("Partition", "").split(",") if p])
    except DdpkitError as e:
        print(f"ddpkit: {e}", file=sys.stderr, flush=True)
        usable = None
    return decide(record, excluded_now, usable, needed)


def main(argv: list[str] | None = None) -> int:
    """RECORD JOB NODES: print the new ExcNodeList, or nothing. Always 0: the requeue goes on."""
    args = sys.argv[1:] if argv is None else argv
    try:
        record_path, job, needed = args
        decision = plan(record_path, job, int(needed))
    except (DdpkitError, ValueError) as e:
        print(f"ddpkit: --exclude-slow leaves no node out: {e}", file=sys.stderr, flush=True)
        return 0
    for line in decision.lines:
        print(line, file=sys.stderr, flush=True)
    if decision.exc_node_list:
        print(decision.exc_node_list, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
