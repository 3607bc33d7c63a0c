#!/usr/bin/env python
"""Peak memory and speed with and without --activation-checkpointing, side by side: the GPT
example (examples/gpt.py) with long windows and a large batch, so activations outweigh the
model; 2 CPU processes under DDP and FSDP; variants interleaved round by round.

    python benchmarks/activation_memory.py [--rounds 2] [--out benchmarks/results/activation_memory.md]

Per variant: each rank's peak memory (the summary's: peak resident set on a CPU, CUDA max
allocated on a GPU; the most of the ranks), what the plan counts as activations kept for
backward per rank (measured by the ranks on their first step), samples/s over the run and the
CPU time of the whole process tree (the machine is shared: CPU time moves less than wall time).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
import harness  # noqa: E402

SIZES = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 256, "max_samples": 192}
BATCH = 32
VARIANTS = {
    "ddp": ["--strategy", "ddp"],
    "ddp + checkpointing": ["--strategy", "ddp", "--activation-checkpointing"],
    "fsdp": ["--strategy", "fsdp"],
    "fsdp + checkpointing": ["--strategy", "fsdp", "--activation-checkpointing"],
}


def argv(variant: str) -> list[str]:
    task_args = [a for k, v in SIZES.items() for a in ("--task-arg", f"{k}={v}")]
    return [
        "{python}",
        "-m",
        "ddpkit",
        "train",
        "examples/gpt.py:build",
        "--nproc",
        "2",
        "--epochs",
        "1",
        "--batch-size",
        str(BATCH),
        "--save-every",
        "0",
        "--quiet",
        "--run-dir",
        "{tmp}/run",
        *task_args,
        *VARIANTS[variant],
    ]


def run(variant: str) -> dict:
    env = {"PYTHONPATH": str(ROOT / "src"), "DDPKIT_BENCH_RESULT": "1"}
    s = harness.require(harness.run_cmd(variant, argv(variant), env, timeout=900, cwd=str(ROOT)))
    return {
        "variant": variant,
        "peak_mib": max(s["peak_memory_bytes"]) / 2**20,
        "kind": s["peak_memory_kind"],
        "activations_mib": (s.get("activation_bytes_per_rank") or 0) / 2**20,
        "samples_per_s": s["samples_per_s"],
        "cpu_s": s["cpu_s"],
        "eval_loss": s.get("eval_loss"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "activation_memory.md"))
    ns = p.parse_args()
    load_before = os.getloadavg()
    results = []
    for r, variant in harness.interleave(list(VARIANTS), ns.rounds):
        results.append(run(variant))
        print(f"round {r + 1}: {results[-1]}", flush=True)
    load_after = os.getloadavg()
    head = [
        "variant",
        "peak memory per rank, MiB",
        "activations kept per rank, MiB",
        "samples/s",
        "CPU s",
        "eval loss",
    ]
    rows = []
    for variant in VARIANTS:
        runs = [x for x in results if x["variant"] == variant]
        cells = [harness.spread([x[k] for x in runs], f) for k, f in (("peak_mib", ".0f"), ("activations_mib", ".1f"))]
        cells += [harness.spread([x[k] for x in runs], ".1f") for k in ("samples_per_s", "cpu_s")]
        rows.append([variant, *cells, f"{runs[0]['eval_loss']:.4f}"])
    sizes = ", ".join(f"{k}={v}" for k, v in SIZES.items())
    text = "\n".join(
        [
            "# Activation checkpointing: peak memory and speed",
            "",
            f"{harness.measured(load_before, load_after)}; {ns.rounds} interleaved rounds; "
            f"examples/gpt.py with {sizes}, --batch-size {BATCH} per process, 2 processes, 1 epoch.",
            f"Peak memory: {results[0]['kind']} (the whole process: torch itself, the model, the data, "
            "the activations). Cells: median (min-max).",
            f"`python benchmarks/activation_memory.py --rounds {ns.rounds}`",
            "",
            *harness.md_table(head, rows),
            "",
        ]
    )
    Path(ns.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
