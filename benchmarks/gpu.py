#!/usr/bin/env python
"""The MLP on one GPU: a hand-written DDP loop vs ddpkit, fp32 and bf16, samples/s.

    python benchmarks/gpu.py [--device cuda|cpu] [--batch-size 4096] [--steps 50] [--rounds 2]
                             [--threads N] [--out benchmarks/results/gpu.md] [--json PATH]

The workload is benchmarks/tasks/mlp.py (9.46M parameters, SGD lr 0.01) with a larger batch
(default 4096 per process) so that the GPU does real work. Every variant runs 2 passes over
a data set of `--steps` batches: the first pass is the warm-up (CUDA context, cuBLAS handles,
allocator), the second is timed ("steady samples/s", the figure compared). The hand-written
loop times its second pass between torch.cuda.synchronize() calls; ddpkit's figure is the
second epoch's samples_per_s of its metrics.jsonl (its epoch ends on a `.item()` of the
epoch's loss, a synchronisation). samples/s is the whole run, warm-up included.

Rows (one process: ddpkit starts no process group and no DDP with one process, so its rows
are a plain model; the hand-written loop is torchrun + NCCL + DDP of world size 1):
  hw-ddp-*          hand-written DDP, batches gathered on the CPU and copied to the GPU
                    (ddpkit's data path: in-memory tensors indexed on the host)
  hw-ddp-devdata-*  the same with the data set on the GPU: no host gather or copy (the bound
                    of the data path)
  ddpkit-*          ddpkit train benchmarks/tasks/mlp.py:build --nproc 1 --epochs 2: by default the
                    data set (a TensorDataset, 1/10 of the device's memory at most) is kept on the
                    device and each batch indexed there (summary "data": "on device"), and SGD is
                    fused on a GPU (--fused-optimizer auto)
  ddpkit-hostdata-* the same with --data-on-device off: batches gathered on the host and copied
`--device cpu` runs the same rows on the CPU with gloo (a dry run of this script, at tiny sizes).
Variants run interleaved (A B C ... A B C) over `--rounds` rounds, through harness.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
import harness  # noqa: E402

PY = "{python}"
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
HW = TORCHRUN + ["benchmarks/baselines/handwritten_ddp.py", "--workload", "mlp", "--bucket-view"]
DDPKIT = [
    PY,
    "-m",
    "ddpkit",
    "train",
    "benchmarks/tasks/mlp.py:build",
    "--nproc",
    "1",
    "--epochs",
    "2",
    "--save-every",
    "0",
    "--run-dir",
    "{tmp}/run",
    "--quiet",
]


def last_epoch(tmp: str) -> dict:
    """ddpkit's steady figure: the last epoch of {tmp}/run/metrics.jsonl."""
    lines = (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()
    rec = json.loads(lines[-1])
    return {"steady_samples_per_s": rec["samples_per_s"], "timed_s": rec["epoch_s"], "epochs_seen": len(lines)}


def variants(device: str, batch: int, steps: int, threads: int) -> list[dict]:
    samples = batch * steps
    hw = HW + [
        "--device",
        device,
        "--batch-size",
        str(batch),
        "--samples",
        str(samples),
        "--epochs",
        "2",
        "--warmup",
        str(steps),
        "--threads",
        str(threads),
    ]
    ddpkit = DDPKIT + ["--device", device, "--batch-size", str(batch), "--threads", str(threads)]
    env = {"PYTHONPATH": str(ROOT / "src"), "DDPKIT_BENCH_RESULT": "1", "BENCH_MLP_SAMPLES": str(samples)}
    out = []
    for prec in ("fp32", "bf16"):
        out += [
            dict(
                name=f"hw-ddp-{prec}",
                world_size=1,
                argv=hw + ["--precision", prec],
                about=f"hand-written DDP (torchrun, 1 process, {'NCCL' if device == 'cuda' else 'gloo'}), "
                f"host-side batches copied to the device, {prec}",
            ),
            dict(
                name=f"hw-ddp-devdata-{prec}",
                world_size=1,
                argv=hw + ["--precision", prec, "--data-on-device"],
                about=f"the same with the data set kept on the device (no host gather/copy), {prec}",
            ),
            dict(
                name=f"ddpkit-{prec}",
                world_size=1,
                env=env,
                collect=last_epoch,
                argv=ddpkit + ["--precision", prec],
                about=f"ddpkit train --nproc 1 --precision {prec} (no process group, no DDP with one process; "
                "the data set kept on the device)",
            ),
            dict(
                name=f"ddpkit-hostdata-{prec}",
                world_size=1,
                env=env,
                collect=last_epoch,
                argv=ddpkit + ["--precision", prec, "--data-on-device", "off"],
                about=f"the same with --data-on-device off: batches gathered on the host and copied, {prec}",
            ),
        ]
    return out


def report(args: argparse.Namespace, vs: list[dict], tab: str, threads: int, elapsed: float) -> str:
    """gpu.md: the machine and workload, the table, the exact commands."""
    import torch

    nccl = f", NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}" if args.device == "cuda" else ""
    md = [
        f"# MLP on one {'GPU' if args.device == 'cuda' else 'CPU (dry run of benchmarks/gpu.py)'}\n",
        f"{harness.machine(args.device)}{nccl}; {threads} CPU threads per process; "
        f"{args.rounds} round(s), interleaved; "
        f"suite took {elapsed:.0f}s.\n",
        f"Workload: benchmarks/tasks/mlp.py (512-2048-2048-2048-10, 9.46M parameters, SGD lr 0.01), batch "
        f"{args.batch_size}, 2 passes of {args.steps} steps ({args.batch_size * args.steps} samples each); "
        "steady samples/s = the second pass (the first is the warm-up), the compared figure; samples/s = both "
        "passes. Cells: median (min-max) over the successful runs.\n",
        tab + "\n",
        "Commands (from the repository root):\n",
    ]
    for v in vs:
        env = " ".join(f"{k}={val}" for k, val in v.get("env", {}).items() if k != "PYTHONPATH")
        cmd = " ".join(a.replace("{python}", "python").replace("{tmp}", "$TMP") for a in v["argv"])
        md.append(f"- `{v['name']}`: {v['about']}: `{(env + ' ') if env else ''}{cmd}`")
    return "\n".join(md) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--batch-size", type=int, default=4096, help="per process (default 4096)")
    ap.add_argument("--steps", type=int, default=50, help="steps per pass; 2 passes, the second timed (default 50)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds per variant (default 2)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads per process (default: all usable cores)")
    ap.add_argument("--timeout", type=float, default=240, help="seconds per run")
    ap.add_argument("--out", default=str(BENCH / "results" / "gpu.md"))
    ap.add_argument("--json", default=None, help="also write every run as JSON here")
    ap.add_argument("--logs", default=None, help="stdout/stderr of each run (default: beside --out, logs-gpu/)")
    args = ap.parse_args()

    threads = args.threads or len(os.sched_getaffinity(0))
    vs = variants(args.device, args.batch_size, args.steps, threads)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = Path(args.logs) if args.logs else out.parent / "logs-gpu"
    t0 = time.perf_counter()
    results = harness.alternate(
        vs, args.rounds, log=lambda m: print(m, flush=True), cwd=str(ROOT), log_dir=str(logs), timeout=args.timeout
    )
    elapsed = time.perf_counter() - t0
    cols = ["steady_samples_per_s", "samples_per_s", "train_s", "wall_s", "final_loss"]
    tab = harness.table(results, baselines=["hw-ddp-fp32", "hw-ddp-bf16"], metric="steady_samples_per_s", columns=cols)
    out.write_text(report(args, vs, tab, threads, elapsed))
    print("\n" + tab + f"\n\nwrote {out} ({elapsed:.0f}s)", flush=True)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "device": args.device,
                    "batch_size": args.batch_size,
                    "steps": args.steps,
                    "rounds": args.rounds,
                    "threads": threads,
                    "elapsed_s": elapsed,
                    "runs": results,
                },
                indent=1,
                default=str,
            )
        )
    return 0 if results and all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
