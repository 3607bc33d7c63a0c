"""CPU-time A/B of this checkout's ddpkit against another checkout's, on run.py's workloads.

    python benchmarks/ab_cpu.py --baseline-src OTHER_CHECKOUT/src [--rounds 4] [--only GPT] [--extra '--strategy fsdp']

Wall time on a shared 2-core machine moves with the load by tens of percent; the CPU time a
run's whole process tree uses (user + sys, getrusage of the children) moves far less. Each
workload runs new and baseline in A-B-B-A order, `--rounds` pairs, from the repository root,
the same argv as run.py's ddpkit-2 rows with PYTHONPATH pointing at one src/ or the other.
Prints one table: medians, the ratio new / baseline and each pair's ratio, plus the
training time the runs report (train_s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
import harness  # noqa: E402

GPT = [
    "examples/gpt.py:build",
    "--epochs",
    "1",
    "--save-every",
    "0",
    "--clip-grad-norm",
    "1.0",
    "--batch-size",
    "16",
    "--task-arg",
    "max_samples=1024",
    "--task-arg",
    "n_layer=4",
    "--task-arg",
    "n_head=4",
    "--task-arg",
    "n_embd=128",
    "--task-arg",
    "block_size=128",
]
WORKLOADS = {
    "Wine, 2 processes, 100 epochs": (["wine", "--nproc", "2"], {}),
    "MLP 9.46M, 2 processes, 1 epoch of 4,096": (
        ["benchmarks/tasks/mlp.py:build", "--nproc", "2", "--epochs", "1", "--save-every", "0", "--batch-size", "256"],
        {"BENCH_MLP_SAMPLES": "4096"},
    ),
    "GPT 0.8M, 2 processes, 1,024 windows": (GPT + ["--nproc", "2"], {}),
}


def run_once(src: str, argv: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    """(CPU s of the whole process tree, wall s, train_s from the summary) of one ddpkit train."""
    argv = ["{python}", "-m", "ddpkit", "train", *argv, "--quiet", "--run-dir", "{tmp}/run"]
    env = {**env, "PYTHONPATH": src, "DDPKIT_BENCH_RESULT": "1"}
    res = harness.require(harness.run_cmd(f"ddpkit from {src}", argv, env, cwd=str(ROOT)))
    return res["cpu_s"], res["wall_s"], float(res["train_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-src", required=True, help="the src/ folder of the other checkout")
    ap.add_argument("--rounds", type=int, default=4, help="A-B-B-A pairs per workload (4)")
    ap.add_argument("--only", default="", help="run only workloads whose name starts with this (Wine, MLP, GPT)")
    ap.add_argument("--extra", default="", help="more `ddpkit train` flags for every run, e.g. '--strategy fsdp'")
    args = ap.parse_args()
    new_src, old_src = str(ROOT / "src"), str(Path(args.baseline_src).resolve())
    print(f"load average at the start: {os.getloadavg()[0]:.1f}", flush=True)
    print(
        "| workload | CPU s new (median) | CPU s baseline | new ÷ baseline | per pair "
        "| train s new | train s baseline |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, (argv, env) in WORKLOADS.items():
        if not name.startswith(args.only):
            continue
        new, old = [], []
        for _, (out, src) in harness.interleave([(new, new_src), (old, old_src)], args.rounds, mirror=True):
            out.append(run_once(src, argv + args.extra.split(), env))
        pairs = ", ".join(f"{a[0] / b[0]:.2f}" for a, b in zip(new, old, strict=True))
        med = [statistics.median(x[i] for x in side) for side in (new, old) for i in (0, 2)]
        print(
            f"| {name} | {med[0]:.2f} | {med[2]:.2f} | {med[0] / med[2]:.3f}x | "
            f"{pairs} | {med[1]:.3f} | {med[3]:.3f} |",
            flush=True,
        )
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
