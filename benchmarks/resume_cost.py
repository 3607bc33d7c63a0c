#!/usr/bin/env python
"""What a resume costs after 10 steps and after 10,000: a map-style set and a stream, 2 CPU
processes, batch 8 per process. Each checkpoint is written once (a run to step S with
--save-every-steps S); then one-step resumes from it are timed, rounds interleaved, each round in
the other order (map 10, map 10000, stream 10, stream 10000, then backwards), so that a
machine getting busier or quieter hits both alike.

    python benchmarks/resume_cost.py [--rounds 3] [--out benchmarks/results/resume_cost.md]

Reports, per kind and step: the wall time of the resuming command (start-up, resume, one
step, exit) and the time inside fit() (the resume and one step), medians and ranges.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
import harness  # noqa: E402

STEPS = (10, 10_000)
KINDS = ("map", "stream")


def train(kind: str, run_dir: Path, max_steps: int, *extra: str) -> tuple[float, dict]:
    argv = [
        "{python}", "-m", "ddpkit", "train", f"{ROOT}/benchmarks/tasks/resume.py:build",
        "--task-arg", f"kind={kind}", "--nproc", "2", "--batch-size", "8", "--epochs", "1",
        "--max-steps", str(max_steps), "--save-every", "0", "--quiet", "--run-dir", str(run_dir), *extra,
    ]  # fmt: skip
    env = {"PYTHONPATH": str(ROOT / "src"), "DDPKIT_BENCH_RESULT": "1"}
    res = harness.require(harness.run_cmd(f"{kind} {max_steps}", argv, env, timeout=1800))
    return res["wall_s"], res["result"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/resume_cost.md"))
    ap.add_argument("--reuse", help="an earlier run's folder (printed at its start): its checkpoints, not new ones")
    args = ap.parse_args()
    tmp = Path(args.reuse or tempfile.mkdtemp(prefix="ddpkit-resume-cost-"))
    print(f"in {tmp}", flush=True)
    written: dict[tuple[str, int], Path] = {}
    for kind in KINDS:
        for steps in STEPS:
            run_dir = tmp / f"{kind}-{steps}"
            if args.reuse:
                written[kind, steps] = run_dir
                continue
            wall, _ = train(kind, run_dir, steps, "--save-every-steps", str(steps))
            written[kind, steps] = run_dir
            print(f"checkpoint at step {steps} ({kind}): written in {wall:.1f} s", flush=True)
    times: dict[tuple[str, int], list[tuple[float, float]]] = {k: [] for k in written}
    loads = [os.getloadavg()[0]]  # the machine is shared: its 1-minute load beside every resume
    order = [(kind, steps) for kind in KINDS for steps in STEPS]
    for r, (kind, steps) in harness.interleave(order, args.rounds, mirror=True):
        run_dir = Path(tempfile.mkdtemp(dir=tmp, prefix=f"{kind}-{steps}-r{r}-"))
        shutil.copytree(written[kind, steps], run_dir, dirs_exist_ok=True)
        wall, summary = train(kind, run_dir, steps + 1, "--resume")
        assert summary["steps_done"] == steps + 1, summary
        times[kind, steps].append((wall, summary["fit_s"]))
        loads.append(os.getloadavg()[0])
        print(f"round {r + 1}: {kind} resumed at step {steps}: wall {wall:.2f} s, fit {summary['fit_s']:.2f} s")
    lines = [
        "# Resume cost against the steps done",
        "",
        f"`python benchmarks/resume_cost.py --rounds {args.rounds}`: 2 CPU processes, batch 8 per process; "
        "a checkpoint written at step S, then a resume that trains one more step, timed "
        f"{args.rounds} times, rounds interleaved (every other round in reverse order). Medians (range). "
        f"The machine's 1-minute load average ({os.cpu_count()} cores) during the resumes: "
        f"{min(loads):.1f}-{max(loads):.1f}, median {statistics.median(loads):.1f}.",
        "",
    ]
    rows = [
        [kind, f"{steps:,}", harness.spread([w for w, _ in times[kind, steps]], ".2f")]
        + [harness.spread([f for _, f in times[kind, steps]], ".3f")]
        for kind in KINDS
        for steps in STEPS
    ]
    head = ["data", "resumed at step", "wall of the command (s)", "inside fit(): resume + 1 step (s)"]
    lines += harness.md_table(head, rows)
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
