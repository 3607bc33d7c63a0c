#!/usr/bin/env python
"""Where one optimizer step goes, for each 2-process variant of the MLP and GPT rows of run.py:
the hand-written DDP loop (hw-2x1), the same without gradient sync (hw-2x1-nosync, the compute
bound), ddpkit's default (ddpkit-2: gradients summed in shared memory) and ddpkit with gloo's
all-reduce (ddpkit-2-gloo). Each runs once per round (rounds interleaved) with
DDPKIT_PROFILE_STEPS=A:B (global steps A..B-1 under torch.profiler, the step before as its
warm-up; ddpkit: src/ddpkit/training/profile.py, the baselines: baselines/common.py).

    python benchmarks/step_profile.py [--rounds 3] [--steps 8:28] [--workload mlp|gpt|all]
                                      [--out benchmarks/results/step_profile.md] [--traces DIR]
                                      [--only NAME,NAME] [--reuse] [--src OTHER_CHECKOUT/src]

The variants' commands are run.py's VARIANTS (nothing is repeated here). Writes the .md (a
table per workload: ms per step of rank 0, each part's lower quartile over every profiled step
of every round; then each variant's top ops by self CPU time) and keeps the traces in --traces
(default: a temporary folder, deleted). Text below the line `<!-- notes -->` of an existing .md
is kept. --reuse reads the traces already in --traces (runs only the missing ones); --src
profiles the ddpkit of another checkout (an A/B, or a frozen copy of this one while it is edited).

How a step is split, from the labels ddpkit and the baselines put on the loop (the same names)
and from torch's own op names inside backward (no label inside DDP's hooks):
  wall      a profiler step: one whole loop iteration, data fetch to the next data fetch
  data      step.data: the next batch from the loader
  forward   step.forward (model and loss)
  backward  step.backward minus the gradient sync below
  sync ops  inside backward, what DDP runs after each gradient is accumulated (the torch
            `evaluate_function: AccumulateGrad` minus the accumulation itself): its copy of the
            gradient into the bucket, the comm hook (shm: divide into the slot, sum the slots;
            gloo: divide, c10d::allreduce_ handing the bucket to gloo's thread), and after the
            last gradient DDP's finalisation (copying buckets back into .grad)
  sync wait the time in those regions that no op covers: shm's spin barrier, waiting for gloo's
            thread to finish the last all-reduce, the hooks' Python
  optimizer step.optimizer (clipping, the optimizer, the LR scheduler, zero_grad)
  step other step.run minus forward, backward and optimizer (ddpkit: the step's flags, loss sums)
  between   wall minus data and step.run: the loop's bookkeeping after a step (progress,
            metrics, cadence, the straggler clock)
  gloo thr  CPU time of gloo's own thread in the step (the all-reduce, concurrent with backward
            on the same 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
import harness  # noqa: E402
import run as suite  # noqa: E402  (run.py: VARIANTS, the data set sizes)

NAMES = ("hw-2x1", "hw-2x1-nosync", "ddpkit-2", "ddpkit-2-gloo")
WORKLOADS = ("mlp", "gpt")
COLUMNS = (
    "wall",
    "data",
    "forward",
    "backward",
    "sync ops",
    "sync wait",
    "optimizer",
    "step other",
    "between",
    "gloo thr",
)
ACCUMULATE = "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad"
LABELS = {  # the loop's labels -> the parts they measure
    "step.data": "data",
    "step.run": "run",
    "step.forward": "forward",
    "step.backward": "backward",
    "step.optimizer": "optimizer",
}
MARK = "<!-- notes -->"
TOP = 8


def _spans(events: list[dict], tid: object, lo: float, hi: float) -> list[tuple[dict, list[dict]]]:
    """The main thread's events in [lo, hi), each with its direct children (by time nesting)."""
    inside = sorted((e for e in events if e["tid"] == tid and lo <= e["ts"] < hi), key=lambda e: (e["ts"], -e["dur"]))
    out: list[tuple[dict, list[dict]]] = []
    stack: list[tuple[dict, list[dict]]] = []
    for e in inside:
        while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]:
            stack.pop()
        node = (e, [])
        if stack:
            stack[-1][1].append(e)
        out.append(node)
        stack.append(node)
    return out


def _covered(children: list[dict]) -> float:
    return sum(c["dur"] for c in children)


def split_step(events: list[dict], step: dict) -> tuple[dict[str, float], dict[str, float]]:
    """One profiler step's parts (us) on the main thread, and its ops' self times (us)."""
    tid, lo, hi = step["tid"], step["ts"], step["ts"] + step["dur"]
    part = dict.fromkeys(COLUMNS, 0.0)
    part["wall"] = step["dur"]
    selfs: dict[str, float] = defaultdict(float)
    nodes = _spans(events, tid, lo, hi)
    for e, kids in nodes:
        name = e["name"]
        if name in LABELS:
            part[LABELS[name]] = part.get(LABELS[name], 0.0) + e["dur"]
        elif not name.startswith("ProfilerStep#"):
            selfs[name] += e["dur"] - _covered(kids)
        if name == ACCUMULATE:
            acc = sum(c["dur"] for c in kids if c["name"] == "torch::autograd::AccumulateGrad")
            hooks = [c for c in kids if c["name"] != "torch::autograd::AccumulateGrad"]
            part["sync ops"] += _covered(hooks)
            part["sync wait"] += e["dur"] - acc - _covered(hooks)
        if name == "step.backward" and kids:  # after the last gradient: DDP's finalisation, waits
            last = max(
                (c for c in kids if c["name"].startswith("autograd::engine")), key=lambda c: c["ts"], default=None
            )
            if last is not None:
                tail_lo = last["ts"] + last["dur"]
                tail = [c for c in kids if c["ts"] >= tail_lo]
                part["sync ops"] += _covered(tail)
                part["sync wait"] += e["ts"] + e["dur"] - tail_lo - _covered(tail)
    part["backward"] -= part["sync ops"] + part["sync wait"]
    run = part.pop("run", 0.0)
    part["step other"] = run - part["forward"] - part["backward"] - part["sync ops"] - part["sync wait"]
    part["step other"] -= part["optimizer"]
    part["between"] = part["wall"] - part["data"] - run
    for e in events:  # gloo's thread(s): the all-reduce running beside the main thread
        if e["tid"] != tid and e["name"].startswith("gloo:"):
            overlap = min(hi, e["ts"] + e["dur"]) - max(lo, e["ts"])
            if overlap > 0:
                part["gloo thr"] += overlap
                selfs["[gloo thread] " + e["name"]] += overlap
    return part, selfs


def read_trace(path: Path) -> list[tuple[dict[str, float], dict[str, float]]]:
    """Each profiled step's parts and ops' self times, in ms."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    if not steps:
        raise SystemExit(f"{path}: no profiler step in the trace")
    out = []
    for step in steps:
        parts, selfs = split_step(events, step)
        out.append(({k: v / 1000 for k, v in parts.items()}, {k: v / 1000 for k, v in selfs.items()}))
    return out


def chosen(workloads: tuple[str, ...], only: str = "") -> list[dict]:
    names = only.split(",") if only else NAMES
    return [v for v in suite.VARIANTS if v["workload"] in workloads and v["name"] in NAMES and v["name"] in names]


def profile_all(
    variants: list[dict], rounds: int, steps: str, traces: Path, log: Path, reuse: bool = False, src: str = ""
) -> list[dict]:
    subst = {"samples": suite.MLP_SAMPLES["full"], "gpt_samples": suite.GPT_SAMPLES["full"]}
    runs = []
    for r, v in harness.interleave(variants, rounds):
        where = traces / f"{v['workload']}-{v['name']}-{r}"
        env = {**v.get("env", {}), "DDPKIT_PROFILE_STEPS": steps, "DDPKIT_PROFILE_OUT": str(where)}
        if src and "PYTHONPATH" in env:  # a ddpkit variant: the ddpkit of another checkout
            env["PYTHONPATH"] = src
        if reuse and (where / "rank0.json").is_file():
            res = {"ok": True}
        else:
            res = harness.run_cmd(
                v["name"], v["argv"], env, timeout=600, cwd=str(ROOT), log_dir=str(log), subst=subst,
                log_name=f"{v['workload']}-{v['name']}",
            )  # fmt: skip
        got = {"workload": v["workload"], "name": v["name"], "round": r, "ok": res["ok"]}
        if res["ok"] and (where / "rank0.json").is_file():
            got["steps"] = read_trace(where / "rank0.json")
            if (where / "rank1.json").is_file():
                got["rank1_walls"] = [p["wall"] for p, _ in read_trace(where / "rank1.json")]
            walls = ", ".join(f"{p['wall']:.0f}" for p, _ in got["steps"])
            print(f"[{r + 1}/{rounds}] {v['workload']}/{v['name']}: {walls} ms/step", flush=True)
        else:
            got["ok"] = False
            print(f"[{r + 1}/{rounds}] {v['workload']}/{v['name']}: FAILED {res.get('error', '')[:300]}", flush=True)
        runs.append(got)
    return runs


def low(values: list[float], q: float = 0.25) -> float:
    """The q-quantile (0.25: the lower quartile) of `values`."""
    v = sorted(values)
    x = q * (len(v) - 1)
    i = int(x)
    return v[i] + (v[min(i + 1, len(v) - 1)] - v[i]) * (x - i)


def quiet(dicts: list[dict[str, float]]) -> dict[str, float]:
    """Each key's lower quartile over the profiled steps: on a shared machine another process
    delays a step in whichever part it hits, so a part's undisturbed cost is near its low end."""
    keys = {k for d in dicts for k in d}
    return {k: low([d.get(k, 0.0) for d in dicts]) for k in keys}


def _fmt(x: float) -> str:
    return f"{x:.1f}" if abs(x) < 100 else f"{x:.0f}"


def table(wl: str, runs: list[dict]) -> tuple[list[str], dict[str, dict[str, float]]]:
    head = ["variant", *COLUMNS, "sum of parts", "median wall", "rank 1 median wall", "steps"]
    rows: list[list[str]] = []
    med: dict[str, dict[str, float]] = {}
    for name in NAMES:
        ok = [r for r in runs if r["workload"] == wl and r["name"] == name and r["ok"]]
        if not ok:
            rows.append([name, *("-" for _ in head[1:])])
            continue
        med[name] = m = quiet([p for r in ok for p, _ in r["steps"]])
        walls = [p["wall"] for r in ok for p, _ in r["steps"]]
        r1 = [w for r in ok for w in r.get("rank1_walls", [])]
        total = sum(m[c] for c in COLUMNS if c not in ("wall", "gloo thr"))
        extra = [_fmt(total), _fmt(statistics.median(walls)), _fmt(statistics.median(r1)) if r1 else "-"]
        extra.append(str(len(walls)))
        rows.append([name, *(_fmt(m[c]) for c in COLUMNS), *extra])
    return harness.md_table(head, rows), med


def differences(med: dict[str, dict[str, float]]) -> list[str]:
    """Each ddpkit variant against the hand-written loop and the no-sync bound, part by part
    (wall: the difference of the sums of the parts)."""
    out = []
    for name in ("ddpkit-2", "ddpkit-2-gloo", "hw-2x1"):
        for base in ("hw-2x1-nosync", "hw-2x1"):
            if name == base or name not in med or base not in med:
                continue
            a, b = med[name], med[base]
            diffs = sorted(((a[c] - b[c], c) for c in COLUMNS if c not in ("wall", "gloo thr")), reverse=True)
            wa, wb = sum(a[c] for _, c in diffs), sum(b[c] for _, c in diffs)
            shown = ", ".join(f"{c} {d:+.1f}" for d, c in diffs if abs(d) >= 0.05 * max(1.0, abs(wa - wb)))
            out.append(f"- {name} vs {base}: {wa - wb:+.1f} ms/step ({wb / wa:.2f}x the speed); by part: {shown}")
    return out


def top_ops(wl: str, runs: list[dict]) -> list[str]:
    out = []
    for name in NAMES:
        ok = [r for r in runs if r["workload"] == wl and r["name"] == name and r["ok"]]
        if not ok:
            continue
        mean = quiet([s for r in ok for _, s in r["steps"]])
        top = sorted(mean.items(), key=lambda kv: -kv[1])[:TOP]
        out.append(f"- {name}: " + ", ".join(f"`{k}` {v:.1f}" for k, v in top))
    return out


def render(args: argparse.Namespace, meta: dict, workloads: tuple[str, ...], runs: list[dict]) -> list[str]:
    import torch

    md = [
        "# One step of each 2-process variant, profiled\n",
        f"`python benchmarks/step_profile.py --rounds {args.rounds} --steps {args.steps}` ({meta['took']:.0f} s), "
        f"{meta['date']}, {os.cpu_count()} cores, torch {torch.__version__}, ddpkit {meta['ddpkit']}; "
        f"load average {meta['load'][0]:.2f} before, {meta['load'][1]:.2f} after.\n",
        "ms per optimizer step on rank 0. Each column (wall and every part) is its lower quartile "
        "over all the variant's profiled steps (every round): on this shared machine other work "
        "delays a step in whichever part it hits, so a part's undisturbed cost lies near its low "
        "end; `sum of parts` adds the parts (an undisturbed step), `median wall` is the median step. "
        "The profiler adds a few us per op. The parts (defined in the script's docstring): wall = "
        "data + forward + backward + sync ops + sync wait + optimizer + step other + between; "
        "gloo thr runs beside them, on gloo's own thread.\n",
    ]
    title = {"mlp": "MLP (9.46M params, SGD, batch 256/process)", "gpt": "GPT (0.8M params, AdamW, batch 16/process)"}
    for wl in workloads:
        rows, med = table(wl, runs)
        md += [f"## {title[wl]}\n", *rows, "", "Differences (ms/step, + = slower):\n", *differences(med), ""]
        md += ["Top ops by self CPU time (ms/step, rank 0; gloo's thread marked):\n", *top_ops(wl, runs), ""]
    return md


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", default="8:28", help="A:B, the global steps A..B-1 profiled (of 30 per run)")
    ap.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all four)")
    ap.add_argument("--out", default=str(BENCH / "results" / "step_profile.md"))
    ap.add_argument("--traces", default=None, help="keep the traces and logs here (default: deleted)")
    ap.add_argument("--src", default="", help="the src/ folder of the ddpkit to profile (default: this checkout's)")
    ap.add_argument("--reuse", action="store_true", help="with --traces: read the traces found there, run the rest")
    args = ap.parse_args()
    workloads = WORKLOADS if args.workload == "all" else (args.workload,)
    traces = Path(args.traces) if args.traces else Path(tempfile.mkdtemp(prefix="step_profile_"))
    load0, t0 = os.getloadavg(), time.perf_counter()
    try:
        runs = profile_all(
            chosen(workloads, args.only), args.rounds, args.steps, traces, traces / "logs", args.reuse, args.src
        )
    finally:
        if not args.traces:
            shutil.rmtree(traces, ignore_errors=True)
    meta_file = traces / "run.json"  # when and how the traces were taken (--reuse keeps it)
    if args.reuse and meta_file.is_file():
        meta = json.loads(meta_file.read_text())
    else:
        meta = {
            "took": time.perf_counter() - t0,
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "load": [load0[0], os.getloadavg()[0]],
            "ddpkit": f"`{args.src}`" if args.src else f"`{suite._commit(ROOT)[:100]}`",
        }
        if args.traces:
            meta_file.write_text(json.dumps(meta))
    out = Path(args.out)
    notes = out.read_text().partition(MARK)[2] if out.is_file() else ""
    md = render(args, meta, workloads, runs)
    out.write_text("\n".join(md) + f"\n{MARK}{notes}")
    print(f"wrote {out}")
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
