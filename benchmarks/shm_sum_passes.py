#!/usr/bin/env python
"""What the exact gradient sum through shared memory costs on this machine, part by part, and
whether cutting it into cache-sized chunks would pay: 2 processes, one bucket of the MLP's
9.46M float32 gradients (38 MB), caches evicted before every repetition (in a training step
the backward's matrix products have filled them with other data).

    python benchmarks/shm_sum_passes.py [--reps 15] [--out benchmarks/results/shm_sum_passes.md]

Rows (median and lower quartile over the repetitions, rank 0's time; both ranks run each row
at once):
  slots of ...       runtime/shm.py's all-reduce (as DDP's hook runs it) with slots of that
                     size: the halved bucket into this rank's slot, a barrier, the two slots
                     added into the bucket; a slot smaller than the bucket takes it in pieces,
                     the two sets of slots alternating (a barrier each), so the add can read
                     from cache what was just written instead of from memory
  ddpkit's default   the slot size runtime/shm.py picks for 2 ranks
  DDP's copy         DDP's copy of fresh gradients into its bucket (before any hook runs)
  one add            a plain add of two private 38 MB tensors: the least an exact sum that
                     reads both ranks' gradients costs, without any sharing
The issue's target (the MLP >= 0.95x the no-sync bound) leaves the sync 5% of the no-sync step
(benchmarks/results/step_profile.md: 200 ms there, so ~10.5 ms for copy, sum and wait).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from ddpkit.runtime.shm import ShmAllReduce  # noqa: E402

NUMEL = 9_460_000  # the MLP workload's parameters (benchmarks/tasks/mlp.py)
CHUNKS_MB = (0.5, 1, 2, 4, 8)


def _worker(rank: int, port: int, reps: int, out: dict) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    sizes = {"whole bucket": NUMEL, **{f"{mb:g} MB": int(mb * 2**18) for mb in CHUNKS_MB}}
    states = {name: ShmAllReduce.create(NUMEL, chunk_elems=n) for name, n in sizes.items()}  # collective
    default = ShmAllReduce.create(NUMEL)
    bucket, fresh, other, result = (torch.randn(NUMEL) for _ in range(4))
    junk = torch.empty(24 << 20)  # 96 MB: more than the last-level cache
    rows = {
        **{f"slots of {name}": (lambda s=s: s.all_reduce_mean_(bucket)) for name, s in states.items()},
        f"ddpkit's default ({default.chunk * 4 / 2**20:g} MB)": lambda: default.all_reduce_mean_(bucket),
        "DDP's copy": lambda: bucket.copy_(fresh),
        "one add": lambda: torch.add(fresh, other, out=result),
    }
    times: dict[str, list[float]] = {name: [] for name in rows}
    for rep in range(reps + 2):
        for name, run in rows.items():
            junk.fill_(rep)
            default.barrier()
            t0 = time.perf_counter()
            run()
            if rep >= 2:  # the first two warm the pages and the allocator
                times[name].append((time.perf_counter() - t0) * 1e3)
            bucket.normal_()
    if rank == 0:
        out.update(times)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "shm_sum_passes.md")
    args = parser.parse_args()
    from ddpkit.environments.network import free_port

    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_worker, args=(free_port(), args.reps, out), nprocs=2, start_method="fork")
        times = dict(out)
    load = os.getloadavg()[0]
    lines = [
        "# The exact gradient sum through shared memory, part by part",
        "",
        f"`python benchmarks/shm_sum_passes.py --reps {args.reps}`, {time.strftime('%Y-%m-%d %H:%M')}, "
        f"2 processes x 1 thread, torch {torch.__version__}, load average {load:.2f} at the end; "
        f"one bucket of {NUMEL / 1e6:.2f}M float32 (38 MB), caches evicted before each repetition. ms, rank 0.",
        "",
        "| row | median | lower quartile |",
        "|---|---|---|",
    ]
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=4)
        lines.append(f"| {name} | {statistics.median(ts):.2f} | {q[0]:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
