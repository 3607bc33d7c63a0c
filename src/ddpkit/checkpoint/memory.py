"""Snapshots in each node's memory (snapshot.py) for a job that restarts its workers: when one is
taken (every K steps; K measured when not given), what it holds (a one-file checkpoint of this
rank's replica), what each node holds when a restart asks, and what the restart cost (steps
redone, seconds from the last step before the failure to the first one after)."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Callable

from ..util.envvars import max_restarts
from .snapshot import SnapshotStore

COST_SHARE = 0.05  # auto: a snapshot may cost this share of a step
MEASURE_STEPS = 5  # auto: steps measured (after the first) before K is chosen


def wanted() -> bool:
    """Whether snapshots are taken in this worker: only a worker that torch's agent restarts
    (--max-restarts) can resume from one."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID")) and max_restarts() > 0


class MemorySnapshots:
    """What a worker does about snapshots. Every rank takes part in the choice of K and in the
    position of a snapshot (a collective inside a pass). DDP: only local rank 0 writes (its
    replica is everyone's); sharded (`store.shard` set): every rank writes its own shards. Local
    rank 0 records the node's last step done."""

    def __init__(self, rt: Any, every: int | None, store: SnapshotStore | None, sharded: bool = False) -> None:
        self.rt, self.store, self.sharded = rt, store, sharded
        self.marks = store is not None and rt.env.local_rank == 0
        self.auto = every is None
        self.every = every or 1
        self.calls, self.cost, self.started, self.last_call = 0, 0.0, 0.0, 0.0
        self.recovery: dict[str, Any] | None = None
        self._failed_at: float | None = None

    def after_step(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        """At every step boundary: a snapshot when one is due (`state()`: the checkpoint to keep,
        a copy the training does not change), the step done, and K once measured."""
        t0 = time.perf_counter()
        if step % self.every == 0:
            taken = state()
            if self.store is not None:
                self._keep(lambda: self.store.write(step, taken))
        if self.store is not None and self.marks:
            self._keep(lambda: self.store.mark(step))
        if self._failed_at is not None:
            self._report_recovery()
        self._measure(t0)

    def _keep(self, write: Callable[[], None]) -> None:
        """A snapshot that cannot be written (memory full) must not stop the training: this node
        stops offering snapshots and a restart uses the others' or the disk checkpoint."""
        try:
            write()
        except OSError as e:
            folder = self.store.folder if self.store is not None else "?"
            print(f"ddpkit: warning: cannot keep snapshots in {folder} ({e}); this node goes on without", flush=True)
            self.store = None

    def _measure(self, t0: float) -> None:
        """auto: after MEASURE_STEPS steps, K = the fewest steps whose time covers a snapshot's
        cost COST_SHARE times, rank 0's measure on every rank (the position is a collective)."""
        now = time.perf_counter()
        self.calls += 1
        if not self.auto or self.calls > MEASURE_STEPS + 1:
            return
        if self.calls == 1:
            self.started = now
        else:
            self.cost += now - t0
        if self.calls == MEASURE_STEPS + 1:
            steps = now - self.started - self.cost
            per_step, per_snapshot = steps / MEASURE_STEPS, self.cost / MEASURE_STEPS
            k = max(1, math.ceil(per_snapshot / (COST_SHARE * per_step))) if per_step > 0 else 1
            self.every = int(self.rt.broadcast_object(k))

    # -- a restart ------------------------------------------------------------------
    def held(self) -> dict[str, Any]:
        """What this rank can offer a restart: its node's newest snapshot (sharded: every shard
        file its node holds), its node's last step done."""
        if self.store is None:
            return {}
        if self.sharded:
            return {"shards": self.store.shards(), "progress": self.store.progress()}
        return {"snapshot": self.store.newest(), "progress": self.store.progress()}

    def read(self, step: int, shard: tuple[int, int] | None = None) -> dict[str, Any]:
        assert self.store is not None
        return self.store.read(step, shard)

    def fetch_shards(self, step: int, sources: list[int], count: int) -> dict[str, Any]:
        """Collective: this rank's shards of `step` (shard index: rank % count), read from its
        node's memory when `sources[rank]` is itself, else received from that rank (a node that
        holds them: HSDP's surviving replica group, for the ranks of a node that joined or
        lost its snapshots)."""
        rank = self.rt.rank
        moves = [(src, dst) for dst, src in enumerate(sources) if src != dst]
        got = self.rt.pass_objects(moves, lambda dst: self.read(step, (dst % count, count)))
        return self.read(step, (rank % count, count)) if sources[rank] == rank else got

    def restarted(self, everyone: list[dict[str, Any]], source: str, step: int, disk_step: int | None) -> None:
        """After a failure (a node held its last step done): what the resume redoes; the time to
        training again is taken at the first step done."""
        done = [h["progress"] for h in everyone if h.get("progress")]
        if not done:
            return
        last_step, last_at = max(done)
        self.recovery = {
            "resumed_from": source,
            "resumed_step": step,
            "disk_checkpoint_step": disk_step,
            "last_step_before_failure": last_step,
            "steps_redone": max(0, last_step - step),
            "snapshot_every_steps": self.every,
        }
        self._failed_at = last_at
        started = _process_start()
        if started is not None:  # where the time goes: the agent's restart, then the worker's own start
            self.recovery["seconds_to_workers_started"] = round(started - last_at, 2)
        self.recovery["seconds_to_state_loaded"] = round(time.time() - last_at, 2)

    def _report_recovery(self) -> None:
        assert self.recovery is not None and self._failed_at is not None
        self.recovery["seconds_to_training_again"] = round(time.time() - self._failed_at, 2)
        self._failed_at = None
        r = self.recovery
        disk = r["disk_checkpoint_step"]
        self.rt.print(
            f"ddpkit: recovered from a failure: resumed from {r['resumed_from']} at step {r['resumed_step']} "
            f"(disk checkpoint: {'none' if disk is None else f'step {disk}'}), {r['steps_redone']} step(s) redone, "
            f"training again {r['seconds_to_training_again']:.1f} s after the last step before the failure"
        )

    def end(self) -> None:
        """Collective when sharded: the run's normal end, this node's memory given back (once
        every rank of the node has finished writing into it)."""
        if self.store is not None:
            self.store.wait()
        if self.sharded:
            self.rt.barrier()
        if self.store is not None and self.marks:
            self.store.remove()


def _process_start() -> float | None:
    """When this process started (Linux: /proc), on the wall clock."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def shard_plan(everyone: list[dict[str, Any]], count: int) -> tuple[int, list[int]] | str | None:
    """Which step a sharded run can resume from memory, and from which rank each rank takes its
    shards: the newest step of which every one of this run's `count` shards is held by some
    node (itself when its own node holds its shard, else the lowest rank of the same shard index whose
    node does, else the lowest such rank of any index).
    A str says why memory cannot serve (the shards of another layout, or shards lost with a
    node); None: no node holds any snapshot."""
    held: dict[int, dict[int, list[int]]] = {}  # step -> shard index -> ranks whose node holds it
    counts = set()
    for rank, h in enumerate(everyone):
        for step, index, n in h.get("shards") or ():
            counts.add(n)
            if n == count:
                held.setdefault(step, {}).setdefault(index, []).append(rank)
    if not counts:
        return None
    complete = [step for step, by_index in held.items() if len(by_index) == count]
    if not complete:
        if count not in counts:
            return (
                f"the snapshots in memory hold {'/'.join(map(str, sorted(counts)))} shards of each parameter "
                f"and this run {count}"
            )
        newest = max(held)
        lost = ", ".join(str(i) for i in range(count) if i not in held[newest])
        return (
            f"no node holds shard(s) {lost} of {count} of the newest snapshot (step {newest}): they were on "
            "the lost node(s) (plain FSDP keeps one copy of each shard; --strategy hsdp keeps a replica per node)"
        )
    step = max(complete)
    sources = []
    for rank in range(len(everyone)):
        holders = held[step][rank % count]  # any rank of a node that holds the file can read it
        peers = [r for r in holders if r % count == rank % count]  # its replica-group peers first: one read each
        sources.append(rank if rank in holders else min(peers or holders))
    return step, sources
