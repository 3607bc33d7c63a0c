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
import os
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
import harness  # noqa: E402

VARIANTS = ("blocking", "async")


def checkpoints(tmp: str) -> dict:
    """How many checkpoints the run left in {tmp}/run and their mean size."""
    files = list((Path(tmp) / "run" / "checkpoints").iterdir())
    return {"saves": len(files), "mb_per_checkpoint": sum(f.stat().st_size for f in files) / max(1, len(files)) / 1e6}


def run(variant: str, steps: int) -> dict:
    argv = [
        "{python}",
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
        "{tmp}/run",
    ] + (["--async-save"] if variant == "async" else [])
    env = {"PYTHONPATH": str(ROOT / "src"), "BENCH_MLP_SAMPLES": str(steps * 2 * 256), "DDPKIT_BENCH_RESULT": "1"}
    res = harness.require(harness.run_cmd(variant, argv, env, timeout=900, collect=checkpoints))
    return {"variant": variant, **{k: res[k] for k in ("fit_s", "train_s", "wall_s", "saves", "mb_per_checkpoint")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "checkpoint_save.md"))
    ns = p.parse_args()
    load_before = os.getloadavg()
    results = []
    for r, variant in harness.interleave(VARIANTS, ns.rounds):
        results.append(run(variant, ns.steps))
        print(f"round {r + 1}: {results[-1]}", flush=True)
    load_after = os.getloadavg()
    medians, rows = {}, []
    for variant in VARIANTS:
        runs = [x for x in results if x["variant"] == variant]
        medians[variant] = statistics.median(x["fit_s"] for x in runs)
        rows.append(
            [
                variant,
                harness.spread([x["fit_s"] for x in runs], ".2f"),
                harness.spread([x["wall_s"] for x in runs], ".2f"),
            ]
            + [runs[0]["saves"], f"{runs[0]['mb_per_checkpoint']:.0f}"]
        )
    head = ["variant", "fit s (median, range)", "wall s (median, range)", "checkpoints", "MB each"]
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
            *harness.md_table(head, rows),
            "",
            f"fit time async / blocking: {ratio:.2f}x (fit = training + evaluation + checkpoints inside the run).",
            "",
        ]
    )
    Path(ns.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
