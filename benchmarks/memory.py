#!/usr/bin/env python
"""The memory plan against the measured peak: the GPT example (examples/gpt.py) at three sizes,
under DDP, FSDP and HSDP, with and without activation checkpointing, in fp32 and (where this
CPU has native bf16) bf16; each row the plan's peak per rank (`ddpkit plan --json`, made in
its own process as a user would) beside the run's measured peak (the summary's: the peak
resident set of the largest rank) and their ratio, with --cpu-allocator release (what a run
sized to its memory does by default). Then the allocator's part: the same runs with
--cpu-allocator keep (glibc keeps what it frees: the default of a run not sized) beside
release, peak and speed, interleaved.

    python benchmarks/memory.py [--sizes S,M,L] [--steps 6] [--out benchmarks/results/memory.md]

The target is a ratio of 0.9-1.1 in every row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
import harness  # noqa: E402

SIZES = {
    "S": {"n_layer": 4, "n_embd": 128, "n_head": 4},
    "M": {"n_layer": 6, "n_embd": 384, "n_head": 6},
    "L": {"n_layer": 12, "n_embd": 576, "n_head": 8},
}
COMMON = {"block_size": 128, "max_samples": 256}
BATCH = 8
LAYOUTS = {"ddp": ("ddp", 2, []), "fsdp": ("fsdp", 2, []), "hsdp": ("hsdp", 4, ["--replicate", "2"])}
MiB = 2**20


def task_args(size: str) -> list[str]:
    return [a for k, v in {**SIZES[size], **COMMON}.items() for a in ("--task-arg", f"{k}={v}")]


def settings(layout: str, ckpt: bool, precision: str) -> list[str]:
    strategy, nproc, extra = LAYOUTS[layout]
    return [
        "--strategy",
        strategy,
        "--nproc",
        str(nproc),
        *extra,
        "--precision",
        precision,
        "--batch-size",
        str(BATCH),
        *(["--activation-checkpointing"] if ckpt else []),
    ]


def planned(size: str, layout: str, ckpt: bool, precision: str) -> dict:
    argv = [sys.executable, "-m", "ddpkit", "plan", "examples/gpt.py:build", "--json", "--cpu-allocator", "release"]
    argv += task_args(size) + settings(layout, ckpt, precision)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True).stdout
    return json.loads(out)["strategies"][LAYOUTS[layout][0]]


def measured(size: str, layout: str, ckpt: bool, precision: str, steps: int, allocator: str = "release") -> dict:
    argv = ["{python}", "-m", "ddpkit", "train", "examples/gpt.py:build", *task_args(size)]
    argv += settings(layout, ckpt, precision) + ["--max-steps", str(steps), "--save-every", "0", "--quiet"]
    argv += ["--cpu-allocator", allocator, "--run-dir", "{tmp}/run"]
    env = {"PYTHONPATH": str(ROOT / "src"), "DDPKIT_BENCH_RESULT": "1"}
    name = f"{size} {layout}{' ckpt' if ckpt else ''} {precision} {allocator}"
    return harness.require(harness.run_cmd(name, argv, env, timeout=900, cwd=str(ROOT)))


def plan_rows(sizes: list[str], precisions: list[str], steps: int) -> list[list[str]]:
    rows = []
    for size in sizes:
        for layout in LAYOUTS:
            for ckpt in (False, True):
                for precision in precisions:
                    p = planned(size, layout, ckpt, precision)
                    s = measured(size, layout, ckpt, precision, steps)
                    peak = max(s["peak_memory_bytes"])
                    fixed = s.get("fixed_bytes_per_rank") or 0
                    row = [
                        size,
                        layout + (" + AC" if ckpt else ""),
                        precision,
                        f"{p['fixed'] / MiB:.0f} / {fixed / MiB:.0f}",
                        f"{p['state'] / MiB:.1f}",
                        f"{(p['activations'] or 0) / MiB:.1f}",
                        f"{p['peak'] / MiB:.0f}",
                        f"{peak / MiB:.0f}",
                        f"{peak / p['peak']:.2f}",
                    ]
                    print("  ".join(row), flush=True)
                    rows.append(row)
    return rows


def allocator_rows(steps: int, rounds: int) -> list[list[str]]:
    cases = [("M", "ddp", False), ("M", "fsdp", True)]
    results: dict[tuple, list[dict]] = {}
    for _, (case, allocator) in harness.interleave([(c, a) for c in cases for a in ("release", "keep")], rounds):
        results.setdefault((case, allocator), []).append(measured(*case, "fp32", steps, allocator))
    rows = []
    for case in cases:
        size, layout, ckpt = case
        p = planned(size, layout, ckpt, "fp32")["peak"]
        for allocator in ("release", "keep"):
            runs = results[(case, allocator)]
            peaks = [max(r["peak_memory_bytes"]) / MiB for r in runs]
            rows.append(
                [
                    f"{size} {layout}{' + AC' if ckpt else ''}",
                    allocator,
                    harness.spread(peaks, ".0f"),
                    harness.spread([x / (p / MiB) for x in peaks], ".2f"),
                    harness.spread([r["samples_per_s"] for r in runs], ".1f"),
                    harness.spread([r["cpu_s"] for r in runs], ".1f"),
                ]
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="S,M,L")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2, help="rounds of the allocator comparison")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "memory.md"))
    ns = p.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from ddpkit.strategies.precision import cpu_has_bf16

    precisions = ["fp32", "bf16"] if cpu_has_bf16() else ["fp32"]
    load_before = os.getloadavg()
    rows = plan_rows(ns.sizes.split(","), precisions, ns.steps)
    alloc = allocator_rows(ns.steps, ns.rounds)
    load_after = os.getloadavg()
    ratios = [float(r[-1]) for r in rows]
    sizes = "; ".join(f"{k}: {', '.join(f'{a}={b}' for a, b in v.items())}" for k, v in SIZES.items())
    text = "\n".join(
        [
            "# Memory: the plan against the measured peak",
            "",
            f"{harness.measured(load_before, load_after)}. examples/gpt.py ({sizes}; "
            f"{', '.join(f'{k}={v}' for k, v in COMMON.items())}), --batch-size {BATCH} per process, "
            f"{ns.steps} optimizer steps; DDP and FSDP on 2 processes, HSDP 2x2 on 4 (one machine).",
            "Plan: `ddpkit plan --json` in its own process, the peak per rank of the strategy run "
            "(fixed cost + model state + in flight + activations, or rank 0's end of run). Measured: the "
            "summary's peak resident set of the largest rank. Fixed: the plan's / the run's worker's.",
            f"`python benchmarks/memory.py --sizes {ns.sizes} --steps {ns.steps}`",
            "",
            *harness.md_table(
                [
                    "size",
                    "strategy",
                    "precision",
                    "fixed MiB plan / run",
                    "state MiB",
                    "activations MiB",
                    "plan peak MiB",
                    "measured peak MiB",
                    "measured / plan",
                ],
                rows,
            ),
            "",
            f"Ratio: {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} runs.",
            "",
            f"## The allocator: --cpu-allocator release against keep ({ns.rounds} interleaved rounds, "
            "median (min-max))",
            "",
            *harness.md_table(
                ["run", "--cpu-allocator", "measured peak MiB", "measured / plan", "samples/s", "CPU s"], alloc
            ),
            "",
        ]
    )
    Path(ns.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
