"""Where each rank's step time goes, and which rank holds the others up.

Every rank splits its steps into three parts, measured where ddpkit already stands: waiting
for its next batch (the loader), waiting for the other ranks in the gradient sync that ends
its backward (StepRunner.wait_s: the shared-memory sum's barriers, or, with the backend's
all-reduce, from the last bucket handed over until the last completes; on a GPU, where the
all-reduce is queued rather than waited for, it reads little), and the rest of the step
(forward, backward, the optimizer: "compute"). Nothing is exchanged per step: every `every` steps, and at the end of
the run, one small all-reduce carries every rank's sums (4 numbers a rank), and rank 0 names
a rank whose busy time (data + compute) is more than `threshold` x the median rank's.

What this cannot see: with the backend's all-reduce, a rank slow in its backward makes the
others wait for its early buckets while they still compute, which counts as their "compute".
A slow data loader or a slow forward (a throttled CPU, another job on the GPU) arrive late
at the gradient sync and are named.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ..runtime import Runtime

PARTS = ("data", "compute", "wait")
MIN_GAP_S = 0.005  # a rank must also be this much slower per step, so that jitter is not named


class StepClock:
    """This rank's sums of (data, compute, wait) seconds and steps, for the run and for the
    window since the last exchange; rank 0 keeps the worst finding per rank for the summary."""

    def __init__(
        self, rt: Runtime, every: int, threshold: float = 1.2, say: Callable[[str], None] | None = None
    ) -> None:
        self.rt, self.every, self.threshold, self.say = rt, every, threshold, say
        self.window = [0.0, 0.0, 0.0, 0]
        self.run = [0.0, 0.0, 0.0, 0]
        self.worst: dict[int, dict[str, Any]] = {}
        self.data_t0 = 0.0

    def waiting_for_data(self) -> None:
        self.data_t0 = time.perf_counter()

    def step(self, data_s: float, step_s: float, wait_s: float) -> None:
        for sums in (self.window, self.run):
            sums[0] += data_s
            sums[1] += max(0.0, step_s - wait_s)
            sums[2] += wait_s
            sums[3] += 1

    def step_done(self, global_step: int) -> None:
        """After each optimizer step: the window's exchange when it is due (the same step on every rank)."""
        if self.every and self.rt.distributed and global_step % self.every == 0:
            found = judge(self.exchange(self.window), self.threshold)
            self.window = [0.0, 0.0, 0.0, 0]
            for finding in found:
                self._note(finding, global_step)

    def exchange(self, sums: list[float]) -> list[list[float]]:
        """Every rank's sums (a collective: one all-reduce of 4 x world numbers)."""
        world = self.rt.world_size
        t = torch.zeros(world * 4, dtype=torch.float64, device=self.rt.device)
        t[self.rt.rank * 4 : self.rt.rank * 4 + 4] = torch.tensor(sums, dtype=torch.float64)
        if self.rt.distributed:
            self.rt.collectives.all_reduce_(t)
        flat = t.tolist()
        return [flat[r * 4 : r * 4 + 4] for r in range(world)]

    def summary(self) -> dict[str, Any]:
        """The run's split per rank and the ranks named (a collective: every rank calls it)."""
        ranks = self.exchange(self.run)
        return {
            "step_time_split": [
                {"rank": r, **{f"{p}_s": round(v[i], 4) for i, p in enumerate(PARTS)}, "steps": int(v[3])}
                for r, v in enumerate(ranks)
            ],
            "stragglers": sorted(self.worst.values(), key=lambda f: f["rank"]),
        }

    def _note(self, finding: dict[str, Any], global_step: int) -> None:
        rank = finding["rank"]
        if rank not in self.worst or finding["ratio"] > self.worst[rank]["ratio"]:
            self.worst[rank] = finding
        if self.say is not None and self.rt.is_main:
            per = {p: finding[f"{p}_s_per_step"] for p in PARTS}
            self.say(
                f"ddpkit: rank {rank} is slow: {finding['ratio']:.1f}x the median rank's busy time per step up to "
                f"step {global_step} (data {per['data'] * 1e3:.1f} ms, compute {per['compute'] * 1e3:.1f} ms, "
                f"waiting {per['wait'] * 1e3:.1f} ms a step; most in {finding['where']})"
            )


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
