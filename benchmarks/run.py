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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness.py and variants.py beside this script
import harness  # noqa: E402
from variants import (  # noqa: E402
    BASELINE,
    BENCH,
    DDPKIT_ENV,
    GPT_SAMPLES,
    JUDGE,
    MLP_SAMPLES,
    ROOT,
    VARIANTS,
    WORKLOADS,
)


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
