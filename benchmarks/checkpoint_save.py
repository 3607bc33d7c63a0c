#!/usr/bin/env python
"""Blocking vs --async-save checkpoints, side by side: the 9.46M-parameter MLP (SGD with
momentum, so each checkpoint holds model + one state tensor per parameter: ~76 MB), 2 CPU
processes, a checkpoint every 5 optimizer steps, rounds interleaved (blocking, async, ...).

    python benchmarks/checkpoint_save.py [--rounds 3] [--steps 30] [--out benchmarks/results/checkpoint_save.md]

Reports the training time inside fit() (what a save stalls) and the wall time of the whole
command, per variant: the median over rounds and the range.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(variant: str, steps: int, tmp: Path) -> dict:
    run_dir = tmp / f"{variant}-{time.monotonic_ns()}"
    argv = [
        sys.executable,
        "-m",
        "ddpkit",
        "train",
        f"{ROOT}/benchmarks/tasks/mlp.py:build_momentum",
        "--nproc",
        "2",
        "--batch-size",
        "256",
        "--max-steps",
        str(steps),
        "--save-every-steps",
        "5",
        "--save-every",
        "0",
        "--quiet",
        "--run-dir",
        str(run_dir),
    ] + (["--async-save"] if variant == "async" else [])
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "BENCH_MLP_SAMPLES": str(steps * 2 * 256),
        "DDPKIT_BENCH_RESULT": "1",
    }
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{proc.stdout}\n{proc.stderr}")
    summary = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    saves = len(list((run_dir / "checkpoints").iterdir()))
    size = sum(p.stat().st_size for p in (run_dir / "checkpoints").iterdir()) / max(1, saves)
    shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "variant": variant,
        "fit_s": summary["fit_s"],
        "train_s": summary["train_s"],
        "wall_s": wall,
        "saves": saves,
        "mb_per_checkpoint": size / 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "checkpoint_save.md"))
    ns = p.parse_args()
    load_before = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory(prefix="ddpkit-ckpt-bench-") as tmp:
        for r in range(ns.rounds):
            for variant in ("blocking", "async"):
                results.append(run(variant, ns.steps, Path(tmp)))
                print(f"round {r + 1}: {results[-1]}", flush=True)
    load_after = os.getloadavg()
    rows = [
        "| variant | fit s (median, range) | wall s (median, range) | checkpoints | MB each |",
        "|---|---|---|---|---|",
    ]
    medians = {}
    for variant in ("blocking", "async"):
        runs = [x for x in results if x["variant"] == variant]
        fit = [x["fit_s"] for x in runs]
        wall = [x["wall_s"] for x in runs]
        medians[variant] = statistics.median(fit)
        rows.append(
            f"| {variant} | {statistics.median(fit):.2f} ({min(fit):.2f}-{max(fit):.2f}) | "
            f"{statistics.median(wall):.2f} ({min(wall):.2f}-{max(wall):.2f}) | {runs[0]['saves']} | "
            f"{runs[0]['mb_per_checkpoint']:.0f} |"
        )
    ratio = medians["async"] / medians["blocking"]
    text = "\n".join(
        [
            "# Checkpoints: blocking vs --async-save",
            "",
            f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {os.cpu_count()} cores, "
            f"load average {load_before[0]:.1f} before and "
            f"{load_after[0]:.1f} after; {ns.rounds} interleaved rounds, "
            f"{ns.steps} optimizer steps, a checkpoint every 5.",
            f"`python benchmarks/checkpoint_save.py --rounds {ns.rounds} --steps {ns.steps}`",
            "",
            *rows,
            "",
            f"fit time async / blocking: {ratio:.2f}x (fit = training + evaluation + checkpoints inside the run).",
            "",
        ]
    )
    Path(ns.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
