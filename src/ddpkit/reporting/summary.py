"""The run's summary: its figures (run_summary, add_phases), summary.json and the closing lines
on rank 0 (write_summary, format_summary: the same figures)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config.values import format_bytes
from ..util.envvars import BENCH_RESULT_VAR, LAUNCH_TIME_VAR, RUN_URL_VAR
from .advice import advise, measured_of_summary
from .throughput import compute_line

if TYPE_CHECKING:
    from ..config import BatchPlan, RunConfig
    from ..environments import DistEnv
    from ..runtime import Runtime


def run_summary(
    cfg: RunConfig, env: DistEnv, rt: Runtime, batches: BatchPlan, stats: dict[str, Any], run_dir: Path
) -> dict[str, Any]:
    """summary.json's figures: the world, the batch plan the run trained with, its settings, what
    fit() returned (`stats`) and the run directory. Read while the process group is still up."""
    return {
        "world_size": env.world_size,
        "nnodes": env.nnodes,
        "backend": rt.backend if env.distributed else "none",
        "device": str(rt.device),
        "batch_size": cfg.batch_size,
        "global_batch": batches.global_batch,
        "global_batch_fixed": batches.fixed,
        "accumulate": batches.accumulate,
        "epochs": cfg.epochs,
        "max_steps": cfg.max_steps,
        "eval_every_steps": cfg.eval_every_steps,
        "save_every_steps": cfg.save_every_steps,
        **stats,
        "run_dir": os.environ.get(RUN_URL_VAR) or str(run_dir),  # a bucket's run: its URL, not the staging copy
    }


def add_phases(summary: dict[str, Any], fit_start: float, fit_end: float) -> None:
    """Under a launcher that set LAUNCH_TIME_VAR: the wall time and the phases, seconds since the
    command started: startup (imports, workers, process group, task) ends when fit() starts;
    fit_end_s is when training, evaluation and checkpoints are done (teardown = exit time -
    fit_end_s, measured from outside)."""
    launched = float(os.environ.get(LAUNCH_TIME_VAR, "0") or 0)
    if launched:
        summary["wall_s"] = time.time() - launched
        summary["startup_s"] = fit_start - launched
        summary["fit_s"] = fit_end - fit_start
        summary["fit_end_s"] = fit_end - launched


def add_time(summary: dict[str, Any], now: float | None = None) -> None:
    """summary.json's "time": the wall time since the launch split into the ledger's parts (the mean
    of the ranks; training/ledger.py), "other" for the rest, in seconds and percent of the wall, the
    GPU-busy share where it was sampled; then the doctor's "advice" (advice.py)."""
    parts, launched = summary.pop("time_parts", None), summary.pop("launched", None)
    busy, startup = summary.pop("gpu_busy", None), summary.pop("startup_parts", None)
    if parts is None or launched is None:
        return
    summary["time"] = time_block(parts, (time.time() if now is None else now) - launched, busy)
    if startup and any(startup.values()):  # a first launch's (a restart's start-up is in "restart")
        summary["time"]["startup_parts"] = {p: round(v, 4) for p, v in startup.items()}
    summary["advice"] = advise(measured_of_summary(summary))


def time_block(parts: dict[str, float], wall: float, gpu_busy: float | None = None) -> dict[str, Any]:
    """Seconds and percent per part and "other" (the wall time no part holds: what the parts sum
    to beyond it, from the ranks' clocks, is taken from "other" and never shown below zero)."""
    seconds = {p: round(v, 4) for p, v in parts.items()}
    seconds["other"] = round(max(0.0, wall - sum(parts.values())), 4)
    scale = max(wall, sum(seconds.values()))
    return {
        "wall_s": round(wall, 4),
        "seconds": seconds,
        "percent": {p: round(100 * v / scale, 1) if scale > 0 else 0.0 for p, v in seconds.items()},
        "gpu_busy": None if gpu_busy is None else round(gpu_busy, 4),
    }


def time_lines(t: dict[str, Any]) -> list[str]:
    """The printed summary's block: the parts that hold time, the largest first, four a line."""
    shown = sorted(((p, s) for p, s in t["seconds"].items() if t["percent"][p] >= 0.5), key=lambda x: -x[1])
    cells = [f"{p.replace('_', ' ')} {s:.2f} s ({t['percent'][p]:.0f}%)" for p, s in shown]
    busy = f"; GPU busy {100 * t['gpu_busy']:.0f}% while training" if t.get("gpu_busy") is not None else ""
    lines = [f"  time         wall {t['wall_s']:.2f} s{busy}"]
    lines += ["               " + ", ".join(cells[i : i + 4]) for i in range(0, len(cells), 4)]
    startup = t.get("startup_parts")
    if startup:
        cells = [f"{p.replace('_', ' ')} {v:.2f}" for p, v in startup.items()]
        lines.append("               startup: " + ", ".join(cells) + " s")
    return lines


def top_loss(t: dict[str, Any]) -> tuple[str, float] | None:
    """The part that is not compute holding the most of the wall time (`ddpkit runs`)."""
    losses = [(p, v) for p, v in t.get("percent", {}).items() if p != "compute"]
    return max(losses, key=lambda x: x[1]) if losses else None


def write_summary(summary: dict[str, Any], run_dir: Path, quiet: bool) -> None:
    """Rank 0: summary.json, the closing lines (unless --quiet) and, for `ddpkit bench`, one RESULT line."""
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if not quiet or os.environ.get(BENCH_RESULT_VAR):
        print(format_summary(summary), flush=True)
    if os.environ.get(BENCH_RESULT_VAR):
        print("RESULT " + json.dumps(summary), flush=True)


def batch_split(s: dict[str, Any]) -> str:
    """How the global batch was made: per process x accumulated, or --global-batch-size's shares."""
    k = s.get("accumulate", 1)
    if s.get("global_batch_fixed"):
        return "fixed by --global-batch-size" + (
            f"; shares in {k} micro-batches of at most {s['batch_size']}" if k > 1 else ""
        )
    return f"{s['batch_size']} per process" + (f" x {k} accumulated" if k > 1 else "")


def format_summary(s: dict[str, Any]) -> str:
    def num(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    metric_key = next((k for k in s if k.startswith("eval_") and k != "eval_loss" and s[k] is not None), None)
    lines = [
        "ddpkit: run finished"
        if not s.get("stopped_early")
        else "ddpkit: run stopped early (checkpoint saved; continue with --resume)",
        f"  world size   {s['world_size']} ({s['nnodes']} node{'s' if s['nnodes'] != 1 else ''}), "
        f"backend {s['backend']}, device {s['device']}"
        + (" (gradients summed in shared memory)" if s.get("grad_sync") == "shm" else ""),
        f"  global batch {s['global_batch']} ({batch_split(s)}), {run_length(s)}",
        f"  train loss   {num(s['train_loss'], '.4f')}",
    ]
    if s.get("eval_loss") is not None:
        lines.append(
            f"  eval loss    {num(s['eval_loss'], '.4f')}"
            + (f", {metric_key[5:]} {num(s[metric_key], '.4f')}" if metric_key else "")
        )
    for f in s.get("stragglers") or []:
        if f["where"] != "link":
            lines.append(
                f"  slow rank    {f['rank']}: {f['ratio']:.1f}x the median rank's busy time per step, "
                f"most in {f['where']}"
            )
        elif f["rank"] == f["ranks"][0]:  # one line per node
            lines.append(
                f"  slow link    node {f['node']} (ranks {', '.join(map(str, f['ranks']))}): "
                f"sent {f['link_mb_per_s']:.1f} MB/s, the other nodes {f['others_mb_per_s']:.1f} MB/s (median)"
            )
    if "peak_memory_bytes" in s:
        lines.append(
            f"  strategy     {s['strategy']}, {s['precision']}; "
            f"model state {format_bytes(s['state_bytes_per_rank']['total'])} per rank"
        )
        peaks = s["peak_memory_bytes"]
        lines.append(
            f"  peak memory  {format_bytes(max(peaks))} per rank, the most of {len(peaks)} ({s['peak_memory_kind']})"
        )
        made_of = peak_parts(s)
        if made_of:
            lines.append(f"  made of      {made_of}")
    if s.get("activation_bytes_per_rank") is not None:
        lines.append(
            f"  activations  {format_bytes(s['activation_bytes_per_rank'])} per rank kept for backward"
            + (" (checkpointed blocks keep only their inputs)" if s.get("activation_checkpointing") else "")
        )
    wall = f", wall {s['wall_s']:.2f} s)" if "wall_s" in s else ")"
    t = s.get("throughput") or {}
    tokens = f", {t['tokens_per_s']:,.0f} tokens/s" if t.get("tokens_per_s") else ""
    lines.append(f"  samples/s    {num(s['samples_per_s'], ',.0f')}{tokens} (training {s['train_s']:.2f} s{wall}")
    compute = compute_line(t)
    if compute:
        lines.append(f"  compute      {compute}")
    lines += time_lines(s["time"]) if s.get("time") else []
    lines.append(f"  written to   {s['run_dir']}")
    return "\n".join(lines + (["to try:", *(f"  {line}" for line in s["advice"])] if s.get("advice") else []))


def peak_parts(s: dict[str, Any]) -> str:
    """What the largest peak is made of: the fixed cost, the model state, the activations kept
    for backward (the most of the ranks each), and the rest (what is in flight, the batch, what
    the allocator holds, rank 0's gathered model at the end). Empty without the fixed cost."""
    fixed, act = s.get("fixed_bytes_per_rank"), s.get("activation_bytes_per_rank") or 0
    if fixed is None:
        return ""
    state = s["state_bytes_per_rank"]["total"]
    rest = max(s["peak_memory_bytes"]) - fixed - state - act
    return (
        f"fixed {format_bytes(fixed)} + state {format_bytes(state)} + activations {format_bytes(act)} "
        f"+ the rest {format_bytes(rest) if rest >= 0 else '-' + format_bytes(-rest)} "
        "(in flight, the batch, the allocator, the end of run)"
    )


def run_length(s: dict[str, Any]) -> str:
    """How far the run went in the unit it was asked in: `steps 30/30` for a run by --max-steps
    (its --epochs was overridden, so `epochs 3/100` would be wrong), `epochs 3/100` for a run by
    epochs; both where both matter (a run by steps over several passes, or a run by epochs that
    evaluates or checkpoints every N steps, or stopped inside an epoch)."""
    done, planned = s.get("steps_done"), s.get("steps_planned")
    if done is None:  # a summary.json written before steps were counted
        return f"epochs {s['epochs_done']}/{s['epochs']}"
    steps = f"steps {done}/{planned}" if planned else f"steps {done}"
    if s.get("max_steps"):
        return steps + (f", epoch {s['epochs_done']}" if s["epochs_done"] > 1 else "")
    epochs = f"epochs {s['epochs_done']}/{s['epochs']}"
    if s.get("eval_every_steps") or s.get("save_every_steps") or s.get("stopped_early"):
        return f"{epochs}, {steps}"
    return epochs
