#!/usr/bin/env python
"""Tokens/s of FSDP x TP (a 2x2 dp_shard x tp mesh) against FSDP over all 4 processes, on the same
model (examples/tp_gpt.py) and the same global batch, under `ddpkit train`; then one run of each
with a few steps under torch.profiler (DDPKIT_PROFILE_STEPS), to say what bounds the figure.

    python benchmarks/tp_fsdp.py [--rounds 3] [--steps 30] [--out benchmarks/results/tp_fsdp.md]
                                 [--device cpu|cuda] [--nproc 4] [--size tiny|small|gpt2]

Each round runs both variants (interleaved: a drifting machine hits both alike); the table gives
the median over rounds of tokens/s and samples/s as ddpkit's summary.json counts them (the whole
mesh: global samples per second of training, x tokens per sample), and rank 0's profiled step
split into forward, backward and optimizer, and the time rank 0's main thread spends inside
collectives (c10d ops, functional collectives and their waits, FSDP's all-gather copy-outs
excluded). --device cuda runs the same on GPUs (scripts/gpu_check.sh step 'tp' calls it there).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
TASK = str(ROOT / "examples" / "tp_gpt.py") + ":build"
SIZES = {  # task args: (n_layer, n_embd, n_head, block_size, vocab), per-rank batch of FSDP alone
    "tiny": ("2", "64", "4", "32", "128", 4),
    "small": ("4", "256", "8", "128", "256", 4),
    "gpt2": ("12", "768", "12", "1024", "50304", 2),
}
COMM = re.compile(r"c10d|param_comms|all_reduce|allreduce|all_gather|allgather|reduce_scatter|wait_tensor|send|recv")


def variants(size: str, nproc: int) -> dict[str, list[str]]:
    """The two runs, the same global batch: FSDP over nproc ranks at B each, FSDP x TP 2 at 2B per dp rank."""
    batch = SIZES[size][5]
    return {
        f"fsdp-{nproc}": ["--strategy", "fsdp", "--batch-size", str(batch)],
        f"fsdp-x-tp-{nproc // 2}x2": ["--strategy", "fsdp", "--tp", "2", "--batch-size", str(2 * batch)],
    }


def command(flags: list[str], args: argparse.Namespace, run_dir: Path) -> list[str]:
    layer, embd, head, block, vocab, _ = SIZES[args.size]
    samples = SIZES[args.size][5] * args.nproc * (args.steps + 2)  # one epoch: the steps end it
    task_args = dict(n_layer=layer, n_embd=embd, n_head=head, block_size=block, vocab=vocab, samples=samples)
    cmd = [sys.executable, "-m", "ddpkit", "train", TASK, "--nproc", str(args.nproc), "--device", args.device]
    cmd += [*flags, "--max-steps", str(args.steps), "--save-every", "0", "--quiet", "--run-dir", str(run_dir)]
    for k, v in task_args.items():
        cmd += ["--task-arg", f"{k}={v}"]
    return cmd


def run(name: str, flags: list[str], args: argparse.Namespace, work: Path, profile: str | None = None) -> dict:
    run_dir = work / f"{name}-{time.monotonic_ns()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    if profile:
        env.update(DDPKIT_PROFILE_STEPS=profile, DDPKIT_PROFILE_OUT=str(run_dir / "profile"))
    done = subprocess.run(command(flags, args, run_dir), env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    out = {
        "samples_per_s": summary["samples_per_s"],
        "tokens_per_s": summary["throughput"]["tokens_per_s"],
        "global_batch": summary["global_batch"],
    }
    if profile:
        out["split"] = split_of(run_dir / "profile" / "rank0.json")
        out["ops"] = top_ops(run_dir / "profile" / "rank0.txt")
    return out


def top_ops(table: Path, rows: int = 12) -> str:
    """The head of rank 0's op table (torch's key_averages, by self CPU time)."""
    lines = table.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("Name")), 0)
    return "\n".join(lines[max(0, start - 1) : start + 2 + rows])


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def split_of(trace: Path) -> dict[str, float]:
    """ms per profiled step of rank 0: its labelled parts and the collectives on its main thread."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    main = {e["tid"] for e in events if e.get("name") == "step.run"}
    parts: dict[str, list] = {}
    for e in events:
        name = str(e.get("name", ""))
        if name in ("step.forward", "step.backward", "step.optimizer", "step.run"):
            parts.setdefault(name[5:], []).append((e["ts"], e["ts"] + e["dur"]))
        elif e.get("tid") in main and COMM.search(name) and "copy" not in name:
            parts.setdefault("collectives", []).append((e["ts"], e["ts"] + e["dur"]))
    n = max(1, len(steps))
    out = {k: _union(v) / 1000 / n for k, v in parts.items()}
    out["collective ops"] = len(parts.get("collectives", [])) / n
    out["wall"] = sum(e["dur"] for e in steps) / 1000 / n
    return out


def report(args: argparse.Namespace, results: dict[str, list[dict]], profiles: dict[str, dict]) -> str:
    load = os.getloadavg()
    lines = [
        "# FSDP x TP against FSDP alone: tokens/s at the same global batch",
        "",
        f"`python benchmarks/tp_fsdp.py --size {args.size} --rounds {args.rounds} --steps {args.steps} "
        f"--device {args.device} --nproc {args.nproc}`; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{os.cpu_count()} cores, load average {load[0]:.1f} before; model `examples/tp_gpt.py` at "
        f"n_layer, n_embd, n_head, block_size, vocab = {', '.join(SIZES[args.size][:5])}.",
        "",
        "| variant | global batch | tokens/s (median) | samples/s | rounds |",
        "|---|---|---|---|---|",
    ]
    for name, rows in results.items():
        tok = statistics.median(r["tokens_per_s"] for r in rows)
        sam = statistics.median(r["samples_per_s"] for r in rows)
        each = ", ".join(f"{r['tokens_per_s']:,.0f}" for r in rows)
        lines.append(f"| {name} | {rows[0]['global_batch']} | {tok:,.0f} | {sam:,.1f} | {each} |")
    if not profiles:
        return "\n".join(lines) + "\n"
    head = "Rank 0's profiled step (ms per step, DDPKIT_PROFILE_STEPS; collective ops: the profiler's events a step):"
    lines += ["", head, ""]
    keys = ("wall", "run", "forward", "backward", "optimizer", "collectives", "collective ops")
    lines += ["| variant | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for name, got in profiles.items():
        lines.append(f"| {name} | " + " | ".join(f"{got['split'].get(k, 0):.1f}" for k in keys) + " |")
    for name, got in profiles.items():
        lines += ["", f"{name}, rank 0's ops by self CPU time over the profiled steps:", ""]
        lines += ["```text", got["ops"], "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=str(BENCH / "results" / "tp_fsdp.md"))
    p.add_argument("--no-profile", action="store_true")
    args = p.parse_args()
    todo = variants(args.size, args.nproc)
    results: dict[str, list[dict]] = {name: [] for name in todo}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, flags in todo.items() if r % 2 == 0 else reversed(todo.items()):
                results[name].append(run(name, flags, args, Path(tmp)))
                print(f"round {r + 1} {name}: {results[name][-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
        profiles = {}
        if not args.no_profile:
            steps = f"{max(2, args.steps - 6)}:{args.steps - 1}"
            profiles = {name: run(name, flags, args, Path(tmp), steps) for name, flags in todo.items()}
    text = report(args, results, profiles)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    notes = ""
    if Path(args.out).exists() and "<!-- notes -->" in (old := Path(args.out).read_text()):
        notes = "\n<!-- notes -->" + old.split("<!-- notes -->", 1)[1]
    Path(args.out).write_text(text + notes)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
