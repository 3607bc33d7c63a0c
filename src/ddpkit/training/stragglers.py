"""Where each rank's step time goes, and which rank holds the others up.

Every rank splits its steps into three parts, measured where ddpkit already stands: waiting
for its next batch (the loader), waiting for the other ranks in the gradient sync that ends
its backward (StepRunner.wait_s: the shared-memory sum's barriers, or, with the backend's
all-reduce, from the last bucket handed over until the last completes; on a GPU, where the
all-reduce is queued rather than waited for, it reads little), and the rest of the step
(forward, backward, the optimizer: "compute"). Nothing is exchanged per step: every `every` steps, and at the end of
the run, one small all-reduce carries every rank's sums and node (5 numbers a rank), and rank 0 names
a rank whose busy time (data + compute) is more than `threshold` x the median rank's.

What this cannot see: with the backend's all-reduce, a rank slow in its backward makes the
others wait for its early buckets while they still compute, which counts as their "compute".
A slow data loader or a slow forward (a throttled CPU, another job on the GPU) arrive late
at the gradient sync and are named.

A slow link slows every rank inside the gradient sync, so inside "compute", and not alike: the ranks
of a fast node wait for the slow node's data inside their steps and look busier: the split alone
named a rank of a fast node (measured). On several nodes, rank 0 therefore also times a probe of each
node's link after each exchange (links.py) and names the ranks of a node whose probe took more
than `threshold` x the median node's; in a window where a link is named, no rank is named for
its compute (which holds the sync), only for its data.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ..runtime import Runtime
from .links import judge_links, probe

PARTS = ("data", "compute", "wait")
SLOTS = 5  # a rank's data, compute, wait seconds, steps, its node
MIN_GAP_S = 0.005  # a rank must also be this much slower per step, so that jitter is not named
LINK_MIN_GAP_S = 0.002  # a node's link probe must also take this much longer than the median's


class StepClock:
    """This rank's sums of (data, compute, wait) seconds and steps, for the run and for the
    window since the last exchange; rank 0 keeps the worst finding per rank for the summary."""

    def __init__(
        self,
        rt: Runtime,
        every: int,
        threshold: float = 1.2,
        say: Callable[[str], None] | None = None,
        on_check: Callable[[list[dict[str, Any]], list[int], int], None] | None = None,
    ) -> None:
        self.rt, self.every, self.threshold, self.say = rt, every, threshold, say
        self.on_check = on_check  # rank 0, after each window's findings (reporting/slow_nodes.py)
        self.window = [0.0, 0.0, 0.0, 0]
        self.run = [0.0, 0.0, 0.0, 0]
        self.worst: dict[tuple[int, bool], dict[str, Any]] = {}  # (rank, a link finding): the worst
        self.data_t0 = 0.0
        self.probed = False
        self.outside_cpu_s = 0.0  # this rank's CPU seconds (its main thread) between steps: the framework's own work

    def waiting_for_data(self) -> None:
        self.data_t0 = time.perf_counter()

    def step(self, data_s: float, step_s: float, wait_s: float) -> None:
        for sums in (self.window, self.run):
            sums[0] += data_s
            sums[1] += max(0.0, step_s - wait_s)
            sums[2] += wait_s
            sums[3] += 1

    def between_steps(self, cpu_s: float) -> None:
        """CPU seconds of this thread from one step's end to the next one's data fetch (progress,
        metrics, cadence, this clock's exchange): unlike wall time, not inflated while the
        process waits to be scheduled, so it shows whether the framework's own work per step
        grows with the world size (benchmarks/scale.py)."""
        self.outside_cpu_s += cpu_s

    def step_done(self, global_step: int) -> None:
        """After each optimizer step: the window's exchange when it is due (the same step on every rank)."""
        if self.every and self.rt.distributed and global_step % self.every == 0:
            ranks = self.exchange(self.window)
            self.window = [0.0, 0.0, 0.0, 0]
            nodes = [int(v[4]) for v in ranks]
            found = findings(ranks, self.probe(nodes) if len(set(nodes)) > 1 else {}, self.threshold)
            for finding in found:
                self._note(finding, global_step)
            if self.on_check is not None and self.rt.is_main:
                self.on_check(found, nodes, global_step)

    def probe(self, nodes: list[int]) -> dict[int, float]:
        if not self.probed:  # the first probe of a pair also sets up its connection (NCCL)
            probe(self.rt, nodes)
            self.probed = True
        return probe(self.rt, nodes)

    def exchange(self, sums: list[float]) -> list[list[float]]:
        """Every rank's sums and its node (a collective: one all-reduce of 5 x world numbers)."""
        world = self.rt.world_size
        t = torch.zeros(world * SLOTS, dtype=torch.float64, device=self.rt.device)
        mine = [*sums, self.rt.env.node_rank]
        t[self.rt.rank * SLOTS : (self.rt.rank + 1) * SLOTS] = torch.tensor(mine, dtype=torch.float64)
        if self.rt.distributed:
            self.rt.collectives.all_reduce_(t)
        flat = t.tolist()
        return [flat[r * SLOTS : (r + 1) * SLOTS] for r in range(world)]

    def summary(self) -> dict[str, Any]:
        """The run's split per rank and the ranks named (a collective: every rank calls it)."""
        ranks = self.exchange(self.run)
        return {
            "step_time_split": [
                {"rank": r, **{f"{p}_s": round(v[i], 4) for i, p in enumerate(PARTS)}, "steps": int(v[3])}
                for r, v in enumerate(ranks)
            ],
            "stragglers": [self.worst[k] for k in sorted(self.worst)],
            **({"rank0_between_steps_cpu_s": round(self.outside_cpu_s, 4)} if self.rt.is_main else {}),
        }

    def _note(self, finding: dict[str, Any], global_step: int) -> None:
        key = (finding["rank"], finding["where"] == "link")
        if key not in self.worst or finding["ratio"] > self.worst[key]["ratio"]:
            self.worst[key] = finding
        if self.say is None or not self.rt.is_main:
            return
        if finding["where"] == "link":
            if finding["rank"] == finding["ranks"][0]:  # one line per node
                self.say(
                    f"ddpkit: node {finding['node']} (ranks {', '.join(map(str, finding['ranks']))}) has a slow link: "
                    f"it sent a probe at {finding['link_mb_per_s']:.1f} MB/s, the other nodes at "
                    f"{finding['others_mb_per_s']:.1f} MB/s (median), at step {global_step}; every rank waits for "
                    "it in the gradient sync (no rank is named for its compute meanwhile)"
                )
            return
        per = {p: finding[f"{p}_s_per_step"] for p in PARTS}
        self.say(
            f"ddpkit: rank {finding['rank']} is slow: {finding['ratio']:.1f}x the median rank's busy time per step "
            f"up to step {global_step} (data {per['data'] * 1e3:.1f} ms, compute {per['compute'] * 1e3:.1f} ms, "
            f"waiting {per['wait'] * 1e3:.1f} ms a step; most in {finding['where']})"
        )


def findings(ranks: list[list[float]], probe_s: dict[int, float], threshold: float) -> list[dict[str, Any]]:
    """The window's findings: the busy ranks (judge) and a finding for each rank of a node whose
    link probe was slow (judge_links; `probe_s` is rank 0's, {} elsewhere). While a link is slow,
    every rank's compute holds the sync that waited for it: no rank is named for its compute."""
    ranks_of: dict[int, list[int]] = {}
    for rank, sums in enumerate(ranks):
        ranks_of.setdefault(int(sums[4]), []).append(rank)
    links = [
        {"rank": r, "where": "link", **f}
        for f in judge_links(probe_s, ranks_of, threshold, LINK_MIN_GAP_S)
        for r in f["ranks"]
    ]
    busy = judge(ranks, threshold)
    return [f for f in busy if not (links and f["where"] == "compute")] + links


def judge(ranks: list[list[float]], threshold: float) -> list[dict[str, Any]]:
    """The ranks whose busy time per step (data + compute) exceeds `threshold` x the median
    rank's (and the median by MIN_GAP_S), with where their time goes."""
    per_step = [[v / max(1, sums[3]) for v in sums[:3]] for sums in ranks]
    busy = [d + c for d, c, _ in per_step]
    ordered = sorted(busy)
    mid = len(ordered) // 2
    median = max(1e-9, ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2)
    found = []
    for rank, (b, split) in enumerate(zip(busy, per_step, strict=True)):
        if ranks[rank][3] and b > threshold * median and b - median > MIN_GAP_S:
            found.append(
                {
                    "rank": rank,
                    "ratio": round(b / median, 2),
                    **{f"{p}_s_per_step": round(v, 6) for p, v in zip(PARTS, split, strict=True)},
                    "where": PARTS[max(range(2), key=lambda i: split[i])],
                }
            )
    return found
