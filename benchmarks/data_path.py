#!/usr/bin/env python
"""The data path alone: a training set of tensors gathered on the device (data/placement.py,
`--data-on-device auto`) against the host path (`off`: indexed on the host, then pinned and
copied ahead by training/prefetch.py as `ddpkit train` does), batches per second over whole
passes, with no model. Both paths give the same batches (tests/unit/data/test_placement.py).

    python benchmarks/data_path.py [--device cpu|cuda] [--passes 3] [--repeats 5] [--out FILE.md]

Workloads: the MLP benchmark's data set (15,360 x 512 float32 + labels) at batch 256 and
4096, digits' training set (1,437 images) and Wine's (142 rows) at batch 32. Each cell is the
median of --repeats timings, the two paths interleaved (A B A B ...) so a drifting machine
hits both alike; "x" is the placed path's speed over the host path's.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "src"))
sys.path.insert(0, str(BENCH))

from ddpkit.data import ShardedLoader  # noqa: E402
from ddpkit.training.prefetch import Prefetcher  # noqa: E402


def workloads() -> list[tuple[str, TensorDataset, int]]:
    from tasks.mlp import make_data

    from ddpkit.tasks.digits import digits_tensors
    from ddpkit.tasks.wine import wine_tensors

    x, y = make_data(15360)
    mlp = TensorDataset(x, y)
    dx, dy, _, _ = digits_tensors()
    wx, wy, _, _ = wine_tensors()
    return [
        ("mlp, batch 256", mlp, 256),
        ("mlp, batch 4096", mlp, 4096),
        ("digits, batch 32", TensorDataset(dx, dy), 32),
        ("wine, batch 32", TensorDataset(wx, wy), 32),
    ]


def one_pass_each(data: TensorDataset, batch: int, device: torch.device, placed: bool, passes: int) -> float:
    """Seconds for `passes` passes of this path, every batch on `device` at the end."""
    loader = ShardedLoader(data, batch, device=device if placed else None)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for epoch in range(passes):
        loader.set_epoch(epoch)
        items = loader.iter_steps()
        for batch_, _, _ in items if placed else Prefetcher(items, device):
            last = batch_
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert last[0].device.type == device.type
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: one rank's share)")
    ap.add_argument("--out", default=None, help="also write the table as Markdown here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    for name, data, batch in workloads():
        steps = args.passes * -(-len(data) // batch)
        one_pass_each(data, batch, device, True, 1)  # warm-up: the allocator, the device's copy of the set
        one_pass_each(data, batch, device, False, 1)
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repeats):
            for placed in (True, False):
                times[placed].append(one_pass_each(data, batch, device, placed, args.passes))
        on, off = (steps / statistics.median(times[p]) for p in (True, False))
        rows.append(f"| {name} | {steps} | {off:,.0f} | {on:,.0f} | {on / off:.2f}x |")
        print(rows[-1], flush=True)
    where = torch.cuda.get_device_name(0) if device.type == "cuda" else f"CPU, {args.threads} thread(s)"
    text = "\n".join(
        [
            f"# The data path: batches per second, on the device vs the host path ({where})\n",
            f"{time.strftime('%Y-%m-%d')}; python {platform.python_version()}, torch {torch.__version__}; "
            f"{args.passes} passes per timing, median of {args.repeats}, interleaved. Command: `python "
            f"benchmarks/data_path.py --device {args.device} --passes {args.passes} --repeats {args.repeats}`\n",
            "| workload | batches | host path (loader) batches/s | on the device batches/s | x |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
