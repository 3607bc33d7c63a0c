#!/usr/bin/env python
"""GPT-2 small on one GPU: ddpkit against a hand-written loop of the same model, default and
fast (bf16, compile, fused AdamW), with the MFU of each.

    python benchmarks/gpt_mfu.py [--device cuda|cpu] [--batch-size 8] [--steps 20] [--rounds 1]
        [--n-layer 12 --n-head 12 --n-embd 768 --block-size 1024 --vocab-size 50304]
        [--variants default,fast] [--no-compile] [--peak-tflops P] [--out benchmarks/results/gpt_mfu.md]

The workload is benchmarks/tasks/gpt_synth.py: examples/gpt.py's model at GPT-2 small's shape
(124M parameters) on synthetic tokens, AdamW, the gradient norm clipped at 1.0, batch
--batch-size, 2 passes of --steps steps, the second timed (the first warms up and compiles).
Rows, interleaved over --rounds (harness.py):
  hw-default       benchmarks/baselines/handwritten_gpt_mfu.py: the plain loop, fp32, eager
  ddpkit-default   ddpkit train benchmarks/tasks/gpt_synth.py:build --nproc 1 --clip-grad-norm 1.0
  hw-fast          the loop with bf16 autocast, torch.compile and fused AdamW
  ddpkit-fast      the same with --precision bf16 --compile --fused-optimizer on
Each row's MFU = steady samples/s x the FLOPs of one sample (ddpkit's count, on the meta
device: training/flops.py) / 1e12 / the device's dense peak at the row's precision (ddpkit's
table, reporting/throughput.py; --peak-tflops overrides, and gives a CPU one). ddpkit's rows
also show the MFU ddpkit itself reported in metrics.jsonl, from the same figures.
On a CPU the shape flags make it small enough to check (--no-compile skips torch.compile, which
takes minutes there); tests/unit/bench/test_gpt_mfu.py runs it at a tiny size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT / "src"))
import harness  # noqa: E402

SHAPE = (("n-layer", 12), ("n-head", 12), ("n-embd", 768), ("block-size", 1024), ("vocab-size", 50304))
FAST = {"precision": "bf16", "compile": True, "fused": True}


def last_epoch(tmp: str) -> dict:
    """ddpkit's steady figures: the last epoch of {tmp}/run/metrics.jsonl."""
    rec = json.loads((Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    return {"steady_samples_per_s": rec["samples_per_s"], "timed_s": rec["epoch_s"], "reported_mfu": rec.get("mfu")}


def variants(args: argparse.Namespace) -> list[dict]:
    shape = {k: getattr(args, k.replace("-", "_")) for k, _ in SHAPE}
    threads = ["--threads", str(args.threads)]
    hw = ["{python}", "benchmarks/baselines/handwritten_gpt_mfu.py", "--device", args.device, *threads]
    hw += ["--batch-size", str(args.batch_size), "--steps", str(args.steps)]
    hw += [a for k, v in shape.items() for a in (f"--{k}", str(v))]
    ddpkit = ["{python}", "-m", "ddpkit", "train", "benchmarks/tasks/gpt_synth.py:build", "--nproc", "1"]
    ddpkit += ["--device", args.device, *threads, "--epochs", "2", "--batch-size", str(args.batch_size)]
    ddpkit += ["--clip-grad-norm", "1.0", "--save-every", "0", "--run-dir", "{tmp}/run", "--quiet"]
    ddpkit += [f"--task-arg={k.replace('-', '_')}={v}" for k, v in shape.items()]
    ddpkit += [f"--task-arg=samples={args.steps * args.batch_size}"]
    if args.peak_tflops:
        ddpkit += ["--peak-tflops", str(args.peak_tflops)]
    env = {"PYTHONPATH": str(ROOT / "src"), "DDPKIT_BENCH_RESULT": "1"}  # ddpkit prints its RESULT line
    out = []
    for kind in args.variants:
        fast = kind == "fast"
        hw_fast = ["--fast"] + (["--no-compile"] if args.no_compile else []) if fast else []
        ddpkit_fast = ["--precision", "bf16", "--fused-optimizer", "on"] + ([] if args.no_compile else ["--compile"])
        what = ("bf16, fused AdamW" + ("" if args.no_compile else ", torch.compile")) if fast else "fp32, eager"
        out += [
            dict(name=f"hw-{kind}", precision="bf16" if fast else "fp32", argv=hw + hw_fast, env=env, about=what),
            dict(
                name=f"ddpkit-{kind}",
                precision="bf16" if fast else "fp32",
                argv=ddpkit + (ddpkit_fast if fast else []),
                env=env,
                collect=last_epoch,
                about=what,
            ),
        ]
    return out


def flops_per_sample(args: argparse.Namespace) -> float:
    """ddpkit's count for one sample of the workload (a model on the meta device: no memory)."""
    import torch

    import ddpkit
    from ddpkit.training.flops import count_flops

    sys.path.insert(0, str(BENCH / "tasks"))
    import gpt_synth

    with torch.device("meta"):
        model = gpt_synth.make_model(args.n_layer, args.n_head, args.n_embd, args.block_size, args.vocab_size)
    ids = torch.zeros(args.block_size, dtype=torch.long)
    task = ddpkit.Task(model=model, train_set=[{"idx": ids, "targets": ids}], optimizer=torch.optim.AdamW)
    flops, note = count_flops(task, args.batch_size, task.train_set[0])
    if flops is None:
        raise SystemExit(f"the FLOPs were not counted: {note}")
    return flops


def rows(results: list[dict], vs: list[dict], flops: float, peaks: dict, tokens: int) -> list[list[str]]:
    """One row per variant: medians over its successful runs."""
    out = []
    for v in vs:
        runs = [r for r in results if r["name"] == v["name"] and r.get("ok")]
        if not runs:
            out.append([v["name"], v["about"], "failed", "", "", "", "", ""])
            continue
        sps = statistics.median(r["steady_samples_per_s"] for r in runs)
        tflops = sps * flops / 1e12
        peak = peaks[v["precision"]][0]
        hand = [
            r["steady_samples_per_s"] for r in results if r["name"] == "hw-" + v["name"].split("-")[1] and r.get("ok")
        ]
        reported = [r["reported_mfu"] for r in runs if r.get("reported_mfu") is not None]
        out.append(
            [
                v["name"],
                v["about"],
                f"{sps:,.1f}",
                f"{sps * tokens:,.0f}",
                f"{tflops:.3g}",
                f"{tflops / peak:.1%}" if peak else "-",
                f"{sps / statistics.median(hand):.2f}x" if hand else "-",
                f"{statistics.median(reported):.1%}" if reported else "-",
            ]
        )
    return out


def report(args, vs, table_rows, flops, peaks, elapsed) -> str:

    from ddpkit.reporting.throughput import format_flops

    head = ["variant", "settings", "steady samples/s", "tokens/s", "TFLOP/s", "MFU", "÷ hand-written", "ddpkit's MFU"]
    shape = ", ".join(f"{k} {getattr(args, k.replace('-', '_'))}" for k, _ in SHAPE)
    peak_text = "; ".join(
        f"{prec}: {p:g} TFLOP/s ({src})" if p else f"{prec}: {src}" for prec, (p, src) in peaks.items()
    )
    md = [
        "# GPT-2 small: ddpkit against a hand-written loop, with MFU\n",
        f"{harness.machine(args.device)}; {args.threads} CPU threads; {args.rounds} round(s), interleaved; "
        f"took {elapsed:.0f}s.\n",
        f"Workload: benchmarks/tasks/gpt_synth.py ({shape}), synthetic tokens, AdamW, clip 1.0, batch "
        f"{args.batch_size}, 2 passes of {args.steps} steps, the second timed. FLOPs a sample (ddpkit's count): "
        f"{format_flops(flops)}. Peak per device: {peak_text}. Cells: medians over the rounds.\n",
        *harness.md_table(head, table_rows),
        "\nCommands (from the repository root):\n",
    ]
    for v in vs:
        cmd = " ".join(a.replace("{python}", "python").replace("{tmp}", "$TMP") for a in v["argv"])
        md.append(f"- `{v['name']}`: `{cmd}`")
    return "\n".join(md) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20, help="steps per pass; 2 passes, the second timed (20)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads per process (default: all usable cores)")
    for name, default in SHAPE:
        ap.add_argument(f"--{name}", type=int, default=default, help=f"the model's shape ({default})")
    ap.add_argument("--variants", default="default,fast", help="default, fast or both (default,fast)")
    ap.add_argument("--no-compile", action="store_true", help="the fast rows without torch.compile")
    ap.add_argument("--peak-tflops", type=float, default=None, help="one device's peak (default: ddpkit's table)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run")
    ap.add_argument("--out", default=str(BENCH / "results" / "gpt_mfu.md"))
    ap.add_argument("--json", default=None, help="also write every run as JSON here")
    args = ap.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    if not set(args.variants) <= {"default", "fast"}:
        ap.error("--variants takes default, fast or default,fast")
    args.threads = args.threads or len(os.sched_getaffinity(0))
    return args


def main(argv: list[str] | None = None) -> int:
    import torch

    from ddpkit.reporting.throughput import device_peak

    args = parse(argv)
    flops = flops_per_sample(args)
    peaks = {p: device_peak(torch.device(args.device), p, args.peak_tflops) for p in ("fp32", "bf16")}
    vs = variants(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = harness.alternate(
        vs,
        args.rounds,
        log=lambda m: print(m, flush=True),
        cwd=str(ROOT),
        log_dir=str(out.parent / "logs-gpt-mfu"),
        timeout=args.timeout,
    )
    elapsed = time.perf_counter() - t0
    table_rows = rows(results, vs, flops, peaks, args.block_size)
    out.write_text(report(args, vs, table_rows, flops, peaks, elapsed))
    print(
        "\n".join(
            harness.md_table(
                ["variant", "settings", "samples/s", "tokens/s", "TFLOP/s", "MFU", "÷ hand", "ddpkit's"], table_rows
            )
        )
    )
    print(f"\nwrote {out} ({elapsed:.0f}s)", flush=True)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "flops_per_sample": flops, "runs": results}, default=str)
        )
    return 0 if results and all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
