"""scripts/gpu_check.py's measuring steps: 8 bench (benchmarks/gpu.py), 10 syncdebug
(scripts/sync_check.py), 12 tp (opt-in: a 2x2 mesh on shared ranks, benchmarks/tp_fsdp.py) and 8b
gpt (benchmarks/gpt_mfu.py, sized to the time left); the steps are described in gpu_check_steps.py."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import gpu_check_runs as runs
from gpu_check_steps import found, holds

if TYPE_CHECKING:
    from gpu_check_core import GpuCheck


def script(c: GpuCheck, label: str, argv: list[str], seconds: int, env: dict[str, str] | None = None) -> int:
    """A program of this checkout (a benchmark, sync_check.py) under the time left: its output
    into WORK/out/LABEL.txt and the log."""
    c.note(f"$ {c.python} {' '.join(argv)}")
    out = c.work / "out" / f"{label}.txt"
    rc = c.timed(c.limit(seconds), [c.python, *argv], out, env)
    c.step.commands[-1]["label"] = label
    c.append_log(out)
    return rc


def show_tail(c: GpuCheck, label: str, n: int) -> None:
    for line in c.output(label).splitlines()[-n:]:
        print(f"      | {line}", flush=True)


def step_bench(c: GpuCheck) -> None:
    t0, m = time.monotonic(), c.mode
    env = dict(os.environ)
    if c.set_cublas:
        env.pop("CUBLAS_WORKSPACE_CONFIG", None)  # measure torch's defaults
    batch, steps, rounds = map(str, m.bench)
    md = c.out / "gpu.md" if m.name == "cpu" else Path(__file__).resolve().parents[1] / "benchmarks/results/gpu.md"
    argv = ["benchmarks/gpu.py", "--device", m.dev, "--batch-size", batch, "--steps", steps, "--rounds", rounds]
    argv += ["--out", str(md), "--json", str(c.out / "bench.json"), "--logs", str(c.work / "bench-logs")]
    rc = script(c, "bench", argv, 300, env)
    for log in sorted((c.work / "bench-logs").glob("*.log")):
        c.append_log(log)
    c.note(f"(exit {rc} after {int(time.monotonic() - t0)} s)")
    _print_table(c.output("bench"))
    if c.check("benchmarks/gpu.py exits 0", holds(rc == 0)) is None:
        show_tail(c, "bench", 15)
    if md.is_file() and md != c.out / "gpu.md":
        shutil.copy(md, c.out / "gpu.md")
    c.check("gpu.md written", holds((c.out / "gpu.md").is_file() and (c.out / "gpu.md").stat().st_size > 0))
    line = c.runs_check("every row measured (steady samples/s > 0)", "bench", c.out / "bench.json")
    if line is not None:
        c.add_note(line)


def section(text: str, start: str = "| variant") -> list[str]:
    """The lines from each line starting with `start` to the next empty one (a markdown table)."""
    out, inside = [], False
    for line in text.splitlines():
        inside = inside or line.startswith(start)
        if inside:
            out.append(line)
            inside = line != ""
    return out


def _print_table(text: str) -> None:
    for line in section(text):
        print(line, flush=True)


def step_syncdebug(c: GpuCheck) -> None:
    argv = ["scripts/sync_check.py", "--device", c.mode.dev, "--steps", "20", "--accumulate", "2"]
    rc = script(c, "syncdebug", argv, 120)
    if c.check(f"no host synchronisation inside a step (exit {rc})", holds(rc == 0)) is None:
        show_tail(c, "syncdebug", 8)
    if c.mode.name == "gpu":
        c.check(
            "0 host syncs a step: the default fused AdamW, the device decides",
            found(c, "syncdebug", "fused AdamW: the device decides .*, 0 host syncs a step"),
        )
    c.add_note(next((line[:200] for line in c.output("syncdebug").splitlines() if line.startswith("sync_check:")), ""))
    rc = script(c, "syncdebug-placed", [*argv, "--data-on-device"], 120)
    if c.check(f"no host synchronisation with the data set on the device (exit {rc})", holds(rc == 0)) is None:
        show_tail(c, "syncdebug-placed", 8)


def gpt_variants(c: GpuCheck, left: int) -> list[str] | None:
    """What fits the time left (GPU: ~20 s a row to start and run, ~60 s more a compiled row)."""
    if c.mode.name == "cpu":
        return ["--variants", "fast", "--no-compile"]  # the wiring, not a measurement
    if left >= 170:
        return ["--variants", "default,fast"]
    if left >= 110:
        return ["--variants", "fast"]
    if left >= 45:
        c.add_note(f"compile rows left uncompiled: {left} s left")
        return ["--variants", "fast", "--no-compile"]
    return None


def step_gpt(c: GpuCheck) -> None:
    t0, m = time.monotonic(), c.mode
    json_path, md = c.work / "gpt.json", c.work / "gpt_mfu.md"
    left = m.hard_s - c.elapsed() - 15
    args = gpt_variants(c, left)
    if args is None:
        c.add_note(f"not run: {left} s left")
        c.step.status = "FAIL"
        return
    args += [*m.gpt_shape, "--batch-size", str(m.gpt_batch), "--steps", str(m.gpt_steps), *m.gpt_peak]
    args += ["--timeout", str(c.limit(left))]
    rc = script(
        c, "gpt", ["benchmarks/gpt_mfu.py", "--device", m.dev, *args, "--out", str(md), "--json", str(json_path)], left
    )
    for f in sorted((c.work / "logs-gpt-mfu").glob("*")):
        if f.is_file():
            c.note(f"--- {f.name}")
            c.append_log(f)
    c.note(f"(exit {rc} after {int(time.monotonic() - t0)} s)")
    _print_table(c.output("gpt"))
    if c.check("benchmarks/gpt_mfu.py exits 0", holds(rc == 0)) is None:
        show_tail(c, "gpt", 15)
    if not json_path.is_file():
        return
    line = c.runs_check("every GPT row measured, ddpkit's with its MFU", "gpt", json_path)
    if line is not None:
        c.add_note(line)
    ok, best = runs.run("gpt_mfu", str(json_path))
    c.step.mfu = best.split(" ")[0] if ok else ""
    _add_gpt_table(c, md)
    if m.name == "cpu":
        c.add_note(f"CPU: MFU against a nominal {m.gpt_peak[1]} TFLOP/s")


def _add_gpt_table(c: GpuCheck, md: Path) -> None:
    """The GPT table after the MLP's in gpu.md (or alone, when step 8 did not run)."""
    if not (md.is_file() and md.stat().st_size > 0):
        return
    gpu_md = c.out / "gpu.md"
    if gpu_md.is_file():
        with open(gpu_md, "a") as f:
            f.write("\n" + md.read_text())
    else:
        shutil.copy(md, gpu_md)


def step_tp(c: GpuCheck) -> None:
    """12 tp (opt-in, `--steps 12`: it does not fit the default check's 8 minutes): a 2x2 mesh
    (dp_shard 2 x tp 2) on 4 ranks sharing the device over gloo (DDPKIT_SHARE_GPU=1) trains
    examples/tp_gpt.py, then benchmarks/tp_fsdp.py puts its tokens/s beside FSDP over the 4 ranks
    (one round, no profile) into tp_fsdp.md. Not proved: NCCL, one GPU per rank."""
    share, run = {"DDPKIT_SHARE_GPU": "1"}, c.runs_dir / "tp"
    args = ["examples/tp_gpt.py:build", "--device", c.mode.dev, "--nproc", "4", "--tp", "2", "--strategy", "fsdp"]
    if c.trained("tp-2x2", run, *args, "--batch-size", "8", "--max-steps", "10", "--save-every", "0", env=share):
        desc = f"FSDP x TP 2x2 on 4 ranks sharing {c.mode.expect_device} over gloo"
        c.runs_check(desc, "summary", run, "world_size=4", "backend=gloo", f"device={c.mode.expect_device}")
    md = c.out / "tp_fsdp.md"
    argv = ["benchmarks/tp_fsdp.py", "--device", c.mode.dev, "--size", "small", "--rounds", "1", "--steps", "20"]
    rc = script(c, "tp-bench", [*argv, "--no-profile", "--out", str(md)], 300, {**os.environ, **share})
    if c.check(f"benchmarks/tp_fsdp.py exits 0 (exit {rc})", holds(rc == 0)) is None:
        show_tail(c, "tp-bench", 12)
    _print_table(c.output("tp-bench"))
    c.add_note("4 ranks share one device over gloo; NCCL not exercised")
