#!/usr/bin/env python
"""Side-by-side benchmark: the guide's scripts, a hand-written DDP loop, Accelerate, Fabric
(and ddpkit, once it is importable) on the Wine workload, a 9.46M-parameter MLP and the
GPT example (examples/gpt.py at 0.8M parameters, against a hand-written torchrun loop).

    python benchmarks/run.py [--repeats 3] [--quick] [--out benchmarks/results]
                             [--workload wine|mlp|gpt|all] [--only NAME,NAME] [--list]
                             [--baseline-src OTHER_CHECKOUT/src]
    python benchmarks/run.py --workload gpt --out benchmarks/results/gpt   # the GPT rows alone

Writes OUT/results.md (tables + exact commands), OUT/results.json (every run),
OUT/results.png and OUT/logs/ (stdout/stderr of each run). Variants run interleaved
(A B C A B C ...) so slow drifts of a shared machine hit all of them alike; compare the
ratio columns, not absolute seconds across runs. Needs the bench extra:
`pip install torch==<installed> accelerate lightning matplotlib`.

Wine rows are judged by wall time (measured from outside: launcher, imports, training,
evaluation, teardown); MLP and GPT rows by samples/s of the training loop (GPT: windows of
128 characters per second; its evaluation at the end is outside the timed loop).

--baseline-src PATH (the src/ folder of another ddpkit checkout, e.g. a `git worktree` of an
older commit) adds, right after each selected ddpkit variant, the same command with
PYTHONPATH=PATH, named NAME@baseline; the tables get a column NAME ÷ NAME@baseline.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
import harness  # noqa: E402

PY = "{python}"
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone"]  # == `torchrun --standalone`
# The invocation that really runs 2 CPU processes (see baselines/accelerate_wine.py):
ACCEL_LAUNCH = [
    PY,
    "-m",
    "accelerate.commands.launch",
    "--multi_gpu",
    "--num_processes",
    "2",
    "--num_machines",
    "1",
    "--mixed_precision",
    "no",
    "--dynamo_backend",
    "no",
    "--main_process_port",
    "{port}",
]  # "0" (auto) works only from accelerate 1.7 on
BL = "benchmarks/baselines"
# ddpkit from THIS checkout (not whatever `ddpkit` console script is installed)
DDPKIT_ENV = {"DDPKIT_BENCH_RESULT": "1", "PYTHONPATH": str(ROOT / "src")}
DDPKIT = [PY, "-m", "ddpkit", "train"]
RUN_DIR = ["--run-dir", "{tmp}/run", "--quiet"]
DDPKIT_RUN = ["--save-every", "0", *RUN_DIR]
DDPKIT_MLP = [*DDPKIT, "benchmarks/tasks/mlp.py:build", "--epochs", "1", *DDPKIT_RUN, "--batch-size", "256"]
DDPKIT_MLP_ENV = {**DDPKIT_ENV, "BENCH_MLP_SAMPLES": "{samples}"}  # read by benchmarks/tasks/mlp.py
# The GPT workload: examples/gpt.py at 4 blocks of width 128 over 128 characters (0.8M
# parameters), batch 16 per process, one pass over {gpt_samples} windows, clipping at 1.0,
# the example's warm-up + cosine; baselines/handwritten_gpt.py takes the same sizes.
GPT_SIZES = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128}
DDPKIT_GPT = [
    *DDPKIT,
    "examples/gpt.py:build",
    "--epochs",
    "1",
    "--save-every",
    "0",
    "--clip-grad-norm",
    "1.0",
    *RUN_DIR,
]
DDPKIT_GPT += ["--batch-size", "16", "--task-arg", "max_samples={gpt_samples}"]
DDPKIT_GPT += [a for k, v in GPT_SIZES.items() for a in ("--task-arg", f"{k}={v}")]
HW_GPT = [f"{BL}/handwritten_gpt.py", "--samples", "{gpt_samples}", "--batch-size", "16"]
HW_GPT += [a for k, v in GPT_SIZES.items() for a in (f"--{k.replace('_', '-')}", str(v))]
HW_DDP = f"{BL}/handwritten_ddp.py"


def variant(workload: str, name: str, world_size: int, argv: list[str], about: str, **more: object) -> dict:
    """One row of VARIANTS (its keys below)."""
    return dict(workload=workload, name=name, world_size=world_size, argv=argv, about=about, **more)


def torchrun(nproc: int, *script: str) -> list[str]:
    return [*TORCHRUN, "--nproc-per-node", str(nproc), *script]


def hw_mlp(name: str, nproc: int, about: str, *flags: str) -> dict:
    """The hand-written loop (baselines/handwritten_ddp.py) on the MLP under torchrun."""
    argv = torchrun(nproc, HW_DDP, "--workload", "mlp", "--samples", "{samples}", *flags)
    return variant("mlp", name, nproc, argv, about)


def ddpkit_mlp(name: str, about: str, *flags: str, nproc: int = 2, **more: object) -> dict:
    return variant("mlp", name, nproc, [*DDPKIT_MLP, "--nproc", str(nproc), *flags], about, env=DDPKIT_MLP_ENV, **more)


def ddpkit_gpt(name: str, about: str, *flags: str, nproc: int = 2) -> dict:
    return variant("gpt", name, nproc, [*DDPKIT_GPT, "--nproc", str(nproc), *flags], about, env=DDPKIT_ENV)


def ddpkit_wine(name: str, nproc: int, about: str, *flags: str) -> dict:
    argv = [*DDPKIT, "--nproc", str(nproc), *flags, *RUN_DIR]
    return variant("wine", name, nproc, argv, about, env=DDPKIT_ENV)


# =====================================================================================
# VARIANTS -- the one list to edit. Each entry: workload, name (short, unique), argv
# (placeholders: {python}, {tmp} = fresh per-run temp dir, {port} = a free TCP port,
# {samples} = MLP data set size, {gpt_samples} = GPT training windows),
# world_size (expected; checked against RESULT), optional env, about (legend text),
# optional requires = module that must be importable (else: skipped with a notice).
# Commands run from the repository root. ddpkit prints `RESULT {json}` when
# DDPKIT_BENCH_RESULT=1.
# =====================================================================================
VARIANTS: list[dict] = [
    # ---------------- Wine: the guide's workload (100 epochs, 142 samples, batch 32)
    variant(
        "wine",
        "guide-single",
        1,
        [PY, f"{BL}/guide_single.py", "--save-dir", "{tmp}/ckpt"],
        "the guide's single-process script (+ test eval), default threads",
    ),
    variant(
        "wine",
        "guide-ddp",
        2,
        [PY, f"{BL}/guide_ddp.py", "100", "50", "--save-dir", "{tmp}/ckpt"],
        "the guide's DDP script as written: mp.spawn 2 procs, gloo, 2 threads each",
    ),
    variant(
        "wine",
        "hw-ddp",
        2,
        torchrun(2, HW_DDP, "--workload", "wine"),
        "hand-written DDP loop, torchrun 2x1 thread, DataLoader + DistributedSampler",
    ),
    variant(
        "wine",
        "hw-ddp-index",
        2,
        torchrun(2, HW_DDP, "--workload", "wine", "--loader", "index"),
        "same, batches sliced from in-memory tensors by sampler index",
    ),
    variant(
        "wine",
        "accel-fork",
        2,
        [PY, f"{BL}/accelerate_wine.py", "--workload", "wine", "--nproc", "2", "--launcher", "notebook"],
        "Accelerate notebook_launcher (forks 2 workers), 1 thread each",
    ),
    variant(
        "wine",
        "accel-launch",
        2,
        [*ACCEL_LAUNCH, f"{BL}/accelerate_wine.py", "--workload", "wine", "--nproc", "2", "--launcher", "external"],
        "`accelerate launch --multi_gpu --num_processes 2` + Accelerator(cpu=True)",
    ),
    variant(
        "wine",
        "fabric",
        2,
        [PY, f"{BL}/fabric_wine.py", "--workload", "wine", "--nproc", "2"],
        "Lightning Fabric strategy=ddp, CPU, 2 procs, 1 thread each",
    ),
    # ddpkit as the CLI runs it by default (it evaluates every epoch: --eval-every 1; the
    # baselines evaluate once, at the end -- add "--eval-every", "100" for identical work)
    ddpkit_wine("ddpkit-1", 1, "ddpkit, 1 process"),
    ddpkit_wine(
        "ddpkit-2", 2, "ddpkit, 2 processes, as the CLI runs by default (evaluates every epoch: 100 evaluations)"
    ),
    ddpkit_wine(
        "ddpkit-2-eval-end",
        2,
        "ddpkit, 2 processes, evaluating once at the end like the baselines (identical work)",
        "--eval-every",
        "100",
    ),
    # ---------------- MLP: 9.46M params, batch 256 per process, {samples} samples (one epoch)
    hw_mlp("hw-1x1", 1, "hand-written loop, 1 process x 1 thread (half the machine)", "--threads", "1"),
    hw_mlp("hw-1x2", 1, "hand-written loop, 1 process x 2 threads (the whole machine, no DDP)", "--threads", "2"),
    hw_mlp("hw-2x1", 2, "hand-written DDP, torchrun 2 x 1 thread"),
    hw_mlp("hw-2x1-nosync", 2, "same, every step in model.no_sync(): no all-reduce (the compute bound)", "--no-sync"),
    hw_mlp(
        "hw-2x1-view",
        2,
        "hand-written DDP with gradient_as_bucket_view=True: ddpkit-2-gloo's exact DDP settings",
        "--bucket-view",
    ),
    variant(
        "mlp",
        "accel-fork",
        2,
        [PY, f"{BL}/accelerate_wine.py", "--workload", "mlp", "--nproc", "2", "--launcher", "notebook"]
        + ["--samples", "{samples}"],
        "Accelerate notebook_launcher, 2 x 1 thread",
    ),
    variant(
        "mlp",
        "fabric",
        2,
        [PY, f"{BL}/fabric_wine.py", "--workload", "mlp", "--nproc", "2", "--samples", "{samples}"],
        "Lightning Fabric ddp, 2 x 1 thread",
    ),
    ddpkit_mlp("ddpkit-1", "ddpkit, 1 process (its own thread choice: 2 threads)", nproc=1),
    ddpkit_mlp("ddpkit-2", "ddpkit, 2 processes (batch 256 per process), defaults (gradients summed in shared memory)"),
    ddpkit_mlp(
        "ddpkit-2-gloo",
        "+ --grad-sync backend: gloo's all-reduce, the hand-written loop's settings "
        "(framework overhead vs hw-2x1-view)",
        "--grad-sync",
        "backend",
    ),
    # one row per lever, each on top of ddpkit-2's defaults
    ddpkit_mlp(
        "ddpkit-2-bf16", "+ --grad-compression bf16 (all-reduce in 16 bits, through gloo)", "--grad-compression", "bf16"
    ),
    ddpkit_mlp("ddpkit-2-fp16", "+ --grad-compression fp16", "--grad-compression", "fp16"),
    ddpkit_mlp(
        "ddpkit-2-powersgd", "+ --grad-compression powersgd (rank 4, from step 2)", "--grad-compression", "powersgd"
    ),
    variant(
        "mlp",
        "ddpkit-2-accum2",
        2,
        DDPKIT_MLP[:-2] + ["--batch-size", "128", "--nproc", "2", "--accumulate", "2"],
        "+ --batch-size 128 --accumulate 2 (same 256 per process per step, one all-reduce per 2 micro-batches)",
        env=DDPKIT_MLP_ENV,
    ),
    ddpkit_mlp(
        "ddpkit-2-bucket100-static",
        "+ --bucket-mb 100 --static-graph (one bucket: no overlap)",
        "--bucket-mb",
        "100",
        "--static-graph",
    ),
    ddpkit_mlp("ddpkit-2-bucket5", "+ --bucket-mb 5 (more, smaller buckets: earlier overlap)", "--bucket-mb", "5"),
    ddpkit_mlp("ddpkit-2-fused", "+ --fused-optimizer on (fused SGD)", "--fused-optimizer", "on"),
    ddpkit_mlp(
        "ddpkit-2-compile",
        "+ --compile (compile time counts in the epoch; full suite only)",
        "--compile",
        full_only=True,
    ),
    # ---------------- GPT: examples/gpt.py (0.8M params), batch 16/process, {gpt_samples} windows of 128
    variant(
        "gpt",
        "hw-1x2",
        1,
        torchrun(1, *HW_GPT, "--threads", "2"),
        "hand-written loop, 1 process x 2 threads (the whole machine, no DDP)",
    ),
    variant(
        "gpt",
        "hw-2x1",
        2,
        torchrun(2, *HW_GPT),
        "hand-written DDP loop, torchrun 2 x 1 thread, DataLoader + DistributedSampler over the dict items",
    ),
    variant(
        "gpt",
        "hw-2x1-nosync",
        2,
        torchrun(2, *HW_GPT, "--no-sync"),
        "same, every step in model.no_sync(): no all-reduce (the GPT's compute bound; ranks' models drift apart)",
    ),
    ddpkit_gpt("ddpkit-1", "ddpkit, 1 process (its own thread choice: 2 threads)", nproc=1),
    ddpkit_gpt("ddpkit-2", "ddpkit, 2 processes, defaults (gradients summed in shared memory)"),
    ddpkit_gpt(
        "ddpkit-2-gloo", "+ --grad-sync backend: gloo's all-reduce, as the hand-written loop", "--grad-sync", "backend"
    ),
    ddpkit_gpt("ddpkit-2-fsdp", "+ --strategy fsdp (one unit per block; to fit, not to be fast)", "--strategy", "fsdp"),
]

# how each workload is judged: (metric, baselines for the ratio columns)
JUDGE = {
    "wine": ("wall_s", ["guide-single", "accel-fork", "accel-launch", "hw-ddp"]),
    "mlp": ("samples_per_s", ["hw-2x1", "hw-2x1-nosync", "hw-2x1-view", "ddpkit-2"]),
    "gpt": ("samples_per_s", ["hw-2x1", "hw-2x1-nosync", "ddpkit-2"]),
}
BASELINE = "@baseline"  # suffix of the --baseline-src twin of a ddpkit variant
MLP_SAMPLES = {"full": 30 * 2 * 256, "quick": 12 * 2 * 256}  # 30 / 12 steps at 2 processes
GPT_SAMPLES = {"full": 30 * 2 * 16, "quick": 12 * 2 * 16}  # 30 / 12 steps at 2 processes of 16
WORKLOADS = ("wine", "mlp", "gpt")


def _available(mod: str) -> str | None:
    """None if `mod` can be used, else why not."""
    try:
        if importlib.util.find_spec(mod) is None:
            return f"`{mod}` is not importable"
    except (ImportError, ValueError) as e:
        return f"`{mod}` is not importable ({e})"
    return None


def _skip_reason(v: dict) -> str | None:
    req = v.get("requires")
    if req:
        why = _available(req)
        if why:
            return why
    exe = v["argv"][0]
    if "{" not in exe and "/" not in exe and shutil.which(exe) is None:
        return f"`{exe}` is not on PATH"
    return None


def _with_baseline(chosen: list[dict], src: str) -> list[dict]:
    """chosen, with each ddpkit variant (one running this checkout's src) followed by its
    twin running the ddpkit found in `src`: same argv and env but PYTHONPATH=src."""
    out = []
    for v in chosen:
        out.append(v)
        if v.get("env", {}).get("PYTHONPATH") == DDPKIT_ENV["PYTHONPATH"]:
            out.append(
                {
                    **v,
                    "name": v["name"] + BASELINE,
                    "env": {**v["env"], "PYTHONPATH": src},
                    "about": f"{v['about']}; ddpkit from {src}",
                }
            )
    return out


def _commit(path: Path) -> str:
    p = subprocess.run(
        ["git", "-C", str(path), "log", "-1", "--format=%h %s"], capture_output=True, text=True, check=False
    )
    return p.stdout.strip() or "?"


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "accelerate", "lightning", "scikit-learn", "matplotlib", "ddpkit"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "-"
    return out


def _cmdline(argv: list[str], env: dict | None, subst: dict) -> str:
    fill = {"python": "python", **{k: str(v) for k, v in subst.items()}, "tmp": "$TMP", "port": "$PORT"}
    a = [harness._fill(x, fill) for x in argv]
    if a[:3] == ["python", "-m", "torch.distributed.run"]:
        a = ["torchrun"] + a[3:]
    elif a[:3] == ["python", "-m", "accelerate.commands.launch"]:
        a = ["accelerate", "launch"] + a[3:]
    pre = " ".join(f"{k}={harness._fill(str(v), fill)}" for k, v in (env or {}).items()).replace(str(ROOT), ".")
    return (pre + " " if pre else "") + " ".join(a)


TITLES = {
    "wine": "Wine (the guide's workload: 100 epochs, 142 samples, batch 32)",
    "mlp": "MLP 512-2048-2048-2048-10 (9.46M params), SGD, batch 256/process, {samples} samples",
    "gpt": "GPT example (examples/gpt.py: 4 blocks x 128, 0.8M params), AdamW, warm-up + cosine, clip 1.0, "
    "batch 16/process, {gpt_samples} windows of 128 characters",
}


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=None, help="rounds per variant (default 3; --quick: 1)")
    ap.add_argument("--quick", action="store_true", help="1 round, a smaller MLP data set (~3 min)")
    ap.add_argument("--out", default=str(BENCH / "results"))
    ap.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    ap.add_argument("--only", default="", help="comma-separated variant names")
    ap.add_argument("--samples", type=int, default=None, help="MLP data set size (overrides the default)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per run")
    ap.add_argument("--list", action="store_true", help="print the variants and their commands, run nothing")
    ap.add_argument(
        "--baseline-src",
        metavar="PATH",
        default=None,
        help="src/ folder of another ddpkit checkout: also run each ddpkit variant from it, as NAME@baseline",
    )
    args = ap.parse_args()
    args.baseline = Path(args.baseline_src).resolve() if args.baseline_src else None
    if args.baseline and not (args.baseline / "ddpkit" / "__init__.py").is_file():
        ap.error(f"--baseline-src {args.baseline_src}: no ddpkit/__init__.py there")
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.samples = args.samples or MLP_SAMPLES["quick" if args.quick else "full"]
    return args


def _chosen(args: argparse.Namespace) -> list[dict]:
    """The variants --workload, --quick and --only select, with their --baseline-src twins."""
    chosen = [
        v
        for v in VARIANTS
        if (args.workload == "all" or v["workload"] == args.workload)
        and not (args.quick and v.get("full_only") and not args.only)
        and (not args.only or v["name"] in args.only.split(","))
    ]
    return _with_baseline(chosen, str(args.baseline)) if args.baseline else chosen


def _prime(baseline: Path | None) -> None:
    """Untimed: compile .pyc files and warm the page cache for everything the variants import."""
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch, torch.distributed, sklearn.datasets, "
            "sklearn.model_selection, sklearn.preprocessing\n"
            "for m in ('accelerate', 'lightning.fabric', 'ddpkit'):\n"
            "    try: __import__(m)\n    except Exception: pass",
        ],
        env=harness.clean_env(),
        cwd=ROOT,
        check=False,
    )
    for src in [ROOT / "src"] + ([baseline] if baseline else []):  # every module, lazy imports too
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(src)], cwd=ROOT, check=False)


def _run(runnable: list[dict], args: argparse.Namespace, subst: dict, logs: Path) -> list[dict]:
    """Every runnable variant, workload by workload, its variants interleaved round by round."""
    results = []
    for wl in WORKLOADS:
        vs = [v for v in runnable if v["workload"] == wl]
        if vs:
            print(f"== {wl}", flush=True)
            results += harness.alternate(
                vs,
                args.repeats,
                log=lambda m: print(m, flush=True),
                cwd=str(ROOT),
                log_dir=str(logs),
                timeout=args.timeout,
                subst=subst,
            )
    return results


def _report(args: argparse.Namespace, run: dict, chosen: list[dict], skipped: list, results: list[dict]) -> str:
    """results.md: the header, then per workload its table (once), its commands and what was skipped."""
    baseline, subst = args.baseline, run["subst"]
    md = [
        "# ddpkit benchmark results\n",
        f"{run['date']}; {os.cpu_count()} cores; "
        + ", ".join(f"{k} {v}" for k, v in run["versions"].items())
        + f"; {args.repeats} round(s), interleaved; MLP data set {args.samples} samples; "
        f"suite took {run['elapsed_s']:.0f}s; "
        f"load average {run['loadavg'][0][0]:.2f} before, {run['loadavg'][1][0]:.2f} after.\n",
        *(
            [f"ddpkit: this checkout `{_commit(ROOT)}`; NAME{BASELINE}: PYTHONPATH={baseline} `{_commit(baseline)}`.\n"]
            if baseline
            else []
        ),
        "Cells: median (min-max) over the successful runs. wall s is measured from outside "
        "(launcher start to exit); train s is the training loop inside the processes "
        "(slowest rank); samples/s counts real samples of all processes per second "
        "(Wine: 100 x 142 / train s; MLP: the whole epoch, warm-up included, as ddpkit reports it; "
        "steady samples/s leaves out the first 5 steps). "
        "Compare ratios within one table, not seconds across runs.\n",
    ]
    for wl in WORKLOADS:
        rs = [r for r in results if r.get("workload") == wl]
        sk = [(v, why) for v, why in skipped if v["workload"] == wl]
        if not rs and not sk:
            continue
        metric, bases = JUDGE[wl]
        paired = BASELINE if baseline else ""
        tab = harness.table(rs, baselines=bases, metric=metric, paired_suffix=paired) if rs else "(nothing ran)"
        md += [f"## {TITLES[wl].format(**subst)}\n", tab + "\n", "Commands (from the repository root):\n"]
        for v in [v for v in chosen if v["workload"] == wl]:
            md.append(f"- `{v['name']}`: {v['about']}: `{_cmdline(v['argv'], v.get('env'), subst)}`")
        for v, why in sk:
            md.append(f"- skipped `{v['name']}`: {why}")
        md.append("")
    return "\n".join(md)


def main() -> int:
    args = _args()
    subst = {"samples": args.samples, "gpt_samples": GPT_SAMPLES["quick" if args.quick else "full"]}
    chosen = _chosen(args)
    if args.list:
        for v in chosen:
            print(f"{v['workload']:5} {v['name']:14} {_cmdline(v['argv'], v.get('env'), subst)}")
        return 0
    runnable, skipped = [], []
    for v in chosen:
        why = _skip_reason(v)
        if why:
            print(f"NOTICE: skipping {v['workload']}/{v['name']}: {why}", flush=True)
            skipped.append((v, why))
        else:
            runnable.append(v)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "logs", ignore_errors=True)
    t = time.perf_counter()
    _prime(args.baseline)
    print(
        f"primed imports in {time.perf_counter() - t:.1f}s; {len(runnable)} variants x {args.repeats} rounds, "
        f"MLP samples {args.samples}",
        flush=True,
    )
    load0, t0 = os.getloadavg(), time.perf_counter()
    results = _run(runnable, args, subst, out / "logs")
    run = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "versions": _versions(),
        "elapsed_s": time.perf_counter() - t0,
        "loadavg": [load0, os.getloadavg()],
        "subst": subst,
    }
    report = _report(args, run, chosen, skipped, results)
    (out / "results.md").write_text(report)
    drawn = _write_data(out, args, run, skipped, results)
    wrote = ", ".join(str(out / f) for f in ("results.md", "results.json", *(["results.png"] if drawn else [])))
    print(f"\n{report}\nwrote {wrote} ({run['elapsed_s']:.0f}s)")
    return 0 if all(r.get("ok") for r in results) else 1


def _write_data(out: Path, args: argparse.Namespace, run: dict, skipped: list, results: list[dict]) -> bool:
    """results.json (every run) and results.png (the chart); whether the chart was drawn (not
    without matplotlib: harness.plot says so in one line)."""
    (out / "results.json").write_text(
        json.dumps(
            {
                "versions": run["versions"],
                "repeats": args.repeats,
                "mlp_samples": args.samples,
                "gpt_samples": run["subst"]["gpt_samples"],
                "elapsed_s": run["elapsed_s"],
                "loadavg": run["loadavg"],
                "baseline_src": str(args.baseline) if args.baseline else None,
                "skipped": [{"name": v["name"], "workload": v["workload"], "why": w} for v, w in skipped],
                "runs": results,
            },
            indent=1,
            default=str,
        )
    )
    if not results:
        return False
    drawn = harness.plot(
        results,
        str(out / "results.png"),
        metrics={wl: m for wl, (m, _) in JUDGE.items()},
        title=f"ddpkit benchmark ({os.cpu_count()} cores, {args.repeats} round(s))",
    )
    return drawn is not None


if __name__ == "__main__":
    sys.exit(main())
