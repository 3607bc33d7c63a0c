"""Which SLURM nodes the straggler view named slow, check after check: the record that
`ddpkit slurm --exclude-slow` acts on at the job's next requeue (engines/exclude_slow.py).

A check is one window of the straggler view (training/stragglers.py: every --straggler-every
steps). A node is named at a check when a rank on it is named (for its data, its compute or its
link). The record counts the checks of the whole run, across its requeues, so "consecutive" means
consecutive checks of the run: a node's streak is the number of checks in a row, up to the latest
one, that named it; a check that ran on the node and did not name it ends the streak, and so does
a check it was not part of (the job ran elsewhere). The record lives in the run directory
(RUN_DIR/slow-nodes.json, written whole by rank 0 after each check) because the requeued job is a
new set of processes that continues it.

Nodes go by SLURM's names (those of SLURM_JOB_NODELIST, SLURMD_NODENAME), which is what
ExcNodeList takes: a rank's node id (SLURM_NODEID) is its node's place in the step's node list.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

from ..environments.slurm import hostnames
from ..errors import DdpkitError
from ..util.envvars import SLOW_NODES_FILE_VAR
from ..util.textfile import write_text_atomic

MIN_CHECKS = 2  # a node is left out when the last this-many checks in a row named it
KEEP_NAMINGS = 5  # the latest namings kept per node: what the job log says of it


class SlowNodes:
    """The run's checks so far and, per node, its streak and its latest namings."""

    def __init__(self, checks: int = 0, nodes: dict[str, dict[str, Any]] | None = None) -> None:
        self.checks = checks
        self.nodes = nodes or {}

    @classmethod
    def load(cls, path: str | os.PathLike) -> SlowNodes:
        """The record at `path`; an empty one when there is none yet."""
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as e:
            raise DdpkitError(f"cannot read the slow-node record {path}: {e}") from None
        if not isinstance(data, dict) or not isinstance(data.get("nodes", {}), dict):
            raise DdpkitError(f"{path} is not a slow-node record")
        return cls(int(data.get("checks", 0)), dict(data.get("nodes", {})))

    def save(self, path: str | os.PathLike) -> None:
        write_text_atomic(path, json.dumps({"checks": self.checks, "nodes": self.nodes}, indent=1) + "\n")

    def check(self, named: Mapping[str, dict[str, Any]], step: int) -> None:
        """One more check; `named`: each node it named, with its worst finding (rank, where, ratio)."""
        self.checks += 1
        for name, finding in named.items():
            entry = self.nodes.setdefault(name, {"streak": 0, "last_check": 0, "named": []})
            entry["streak"] = entry["streak"] + 1 if entry["last_check"] == self.checks - 1 else 1
            entry["last_check"] = self.checks
            entry["named"] = [*entry["named"], {"check": self.checks, "step": step, **finding}][-KEEP_NAMINGS:]

    def streak(self, name: str) -> int:
        """How many checks in a row, up to the latest, named `name` (0: not the latest)."""
        entry = self.nodes.get(name)
        return entry["streak"] if entry and entry["last_check"] == self.checks else 0

    def slow(self, min_checks: int = MIN_CHECKS) -> list[str]:
        """The nodes named at each of the last `min_checks` checks (or more), longest streak first."""
        found = [n for n in self.nodes if self.streak(n) >= min_checks]
        return sorted(found, key=lambda n: (-self.streak(n), n))

    def why(self, name: str) -> str:
        """The namings of `name`'s streak, for the job log."""
        named = self.nodes[name]["named"][-self.streak(name) :]
        return "; ".join(f"step {f['step']}: rank {f['rank']}, {f['where']}, {f['ratio']}x the median" for f in named)


def named_nodes(found: list[dict[str, Any]], nodes: list[int], hosts: list[str]) -> dict[str, dict[str, Any]]:
    """The nodes (by name) that a check's findings name, each with its worst finding. `nodes`: each
    rank's node id; `hosts`: the node names by node id."""
    worst: dict[str, dict[str, Any]] = {}
    for f in found:
        name = hosts[f["node"] if f["where"] == "link" else nodes[f["rank"]]]
        if name not in worst or f["ratio"] > worst[name]["ratio"]:
            worst[name] = {"rank": f["rank"], "where": f["where"], "ratio": f["ratio"]}
    return worst


def step_hosts(environ: Mapping[str, str]) -> list[str]:
    """The node names of this srun step by node id (SLURM_NODEID is a place in this list)."""
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or ""
    return hostnames(nodelist) if nodelist else []


class Recorder:
    """Rank 0's hook for each check of the straggler view (StepClock's on_check): the record,
    updated and written whole. A failure to write is said once; training goes on."""

    def __init__(self, path: str, hosts: list[str]) -> None:
        self.path, self.hosts = path, hosts
        self.record: SlowNodes | None = None
        self.failed = False

    def __call__(self, found: list[dict[str, Any]], nodes: list[int], step: int) -> None:
        if self.failed:
            return
        try:
            if self.record is None:
                self.record = SlowNodes.load(self.path)  # the checks of earlier runs of this job
            self.record.check(named_nodes(found, nodes, self.hosts), step)
            self.record.save(self.path)
        except (OSError, DdpkitError) as e:
            self.failed = True
            print(f"ddpkit: warning: no slow-node record for --exclude-slow ({e})", file=sys.stderr, flush=True)


def slow_node_recorder(
    is_main: bool, node_rank: int, environ: Mapping[str, str] = os.environ
) -> Callable[[list[dict[str, Any]], list[int], int], None] | None:
    """The recorder when the job asked for one (SLOW_NODES_FILE_VAR, set by the script of
    `ddpkit slurm --exclude-slow`), on rank 0; None otherwise. Refused (said once, no record)
    when this rank's node is not where the node list puts it: a node left out by a wrong name
    would be a healthy one."""
    path = environ.get(SLOW_NODES_FILE_VAR)
    if not path or not is_main:
        return None
    try:
        hosts = step_hosts(environ)
    except DdpkitError as e:
        hosts, problem = [], str(e)
    else:
        problem = "no SLURM node list"
    mine = environ.get("SLURMD_NODENAME")
    if not hosts or node_rank >= len(hosts) or (mine and hosts[node_rank] != mine):
        if hosts:
            problem = f"node {node_rank} of {','.join(hosts)} is not this node, {mine}"
        print(f"ddpkit: warning: no slow-node record for --exclude-slow: {problem}", file=sys.stderr, flush=True)
        return None
    return Recorder(path, hosts)
