"""The run of scripts/gpu_check.py: the mode (a GPU run or its CPU stand-in), the record of each
step, and GpuCheck, which the steps (gpu_check_steps.py, gpu_check_measure.py) call: the console
and the log, the time limits, the commands, the checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import gpu_check_runs as runs

REPO = Path(__file__).resolve().parents[1]


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name) or default)


@dataclass
class Mode:
    """What differs between a GPU run and its CPU stand-in (--cpu): the device flags, the sizes
    of the benchmarks, the time limits. GPU_CHECK_* variables override the sizes and limits."""

    name: str
    dev: str
    backend: str
    expect_device: str
    peak_kind: str
    ndev: int
    bench: tuple[int, int, int]  # batch, steps, rounds of benchmarks/gpu.py
    gpt_shape: list[str]
    gpt_batch: int
    gpt_steps: int
    gpt_peak: list[str]
    budget_s: int  # no step starts after it
    hard_s: int  # no command runs past it

    @classmethod
    def of(cls, name: str, ngpu: int) -> Mode:
        if name == "gpu":
            # GPT-2 small at block 256 (the first run's notes: ~2,200 samples/s compiled on an H200, ~1 min
            # of compilation a compiled row), 2 passes of GPT_STEPS steps of batch GPT_BATCH a row
            bench = (4096, 30, 1)
            return cls(
                "gpu", "cuda", "nccl", "cuda:0", "cuda max allocated", ngpu, cls._bench(bench),
                ["--block-size", "256"], _env_int("GPU_CHECK_GPT_BATCH", 32), _env_int("GPU_CHECK_GPT_STEPS", 20), [],
                _env_int("GPU_CHECK_BUDGET_S", 400), _env_int("GPU_CHECK_HARD_S", 460),
            )  # fmt: skip
        shape = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--vocab-size", "128"]
        peak = ["--peak-tflops", os.environ.get("GPU_CHECK_CPU_PEAK_TFLOPS") or "1"]
        return cls(
            "cpu", "cpu", "gloo", "cpu", "peak resident set", 2, cls._bench((64, 4, 1)), shape, 2, 3, peak,
            _env_int("GPU_CHECK_BUDGET_S", 1500), _env_int("GPU_CHECK_HARD_S", 2400),
        )  # fmt: skip

    @staticmethod
    def _bench(default: tuple[int, int, int]) -> tuple[int, int, int]:
        names = ("GPU_CHECK_BENCH_BATCH", "GPU_CHECK_BENCH_STEPS", "GPU_CHECK_BENCH_ROUNDS")
        return tuple(_env_int(n, d) for n, d in zip(names, default, strict=True))  # type: ignore[return-value]


@dataclass
class StepRecord:
    id: str
    name: str
    status: str = "PASS"
    secs: int = 0
    mfu: str = ""
    note: str = ""
    checks: list[dict[str, Any]] = field(default_factory=list)
    commands: list[dict[str, Any]] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)  # the run directories the step trained


class GpuCheck:
    """One run of the check: the console and the log, the time limits, the commands, the checks
    and the record of every step. The steps (gpu_check_steps.py) call its methods."""

    def __init__(self, mode: Mode, out: Path, log: Path, work: Path, probe: tuple[str, str, int]) -> None:
        self.mode, self.out, self.log, self.work = mode, out, log, work
        self.torch_version, self.torch_cuda, self.ngpu = probe
        self.python = sys.executable
        self.start = time.monotonic()
        self.cmd_timeout = _env_int("GPU_CHECK_CMD_TIMEOUT", 240)
        self.set_cublas = False
        self.runs_dir = work / "runs"
        self.steps: list[StepRecord] = []
        self.step = StepRecord("", "")
        self.last = ""  # the output of the last check, as a step's note quotes it

    # -- the console and the log ------------------------------------------------------
    def say(self, text: str = "") -> None:
        """The console and the log."""
        print(text, flush=True)
        self.note(text)

    def note(self, text: str) -> None:
        """The log only."""
        with open(self.log, "a") as f:
            f.write(text + "\n")

    def append_log(self, path: Path) -> None:
        if path.is_file():
            with open(self.log, "a") as f:
                f.write(path.read_text(errors="replace"))

    def add_note(self, text: str) -> None:
        if text.strip():
            self.step.note = f"{self.step.note}; {text}" if self.step.note else text

    # -- time ---------------------------------------------------------------------------
    def elapsed(self) -> int:
        return int(time.monotonic() - self.start)

    def limit(self, want: int) -> int:
        """`want` seconds, or less when the hard deadline is nearer."""
        return min(want, self.mode.hard_s - self.elapsed())

    def timed(self, seconds: int, argv: list[str], out: Path, env: dict[str, str] | None = None) -> int:
        """argv from the repository root, its output into `out`, under a time limit: exit 124 when
        it ran out (its whole process group stopped, killed 10 s later if it lingers: 137)."""
        t0 = time.monotonic()
        record: dict[str, Any] = {"argv": argv, "limit_s": seconds}
        self.step.commands.append(record)
        if seconds < 5:
            out.write_text(f"gpu_check: no time left (GPU_CHECK_HARD_S={self.mode.hard_s}) for: {' '.join(argv)}\n")
            record.update(exit=124, secs=0)
            return 124
        with open(out, "w") as f:
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
            try:
                rc = proc.wait(timeout=seconds)
            except subprocess.TimeoutExpired:
                rc = _stop(proc)
            except BaseException:
                _stop(proc)
                raise
        record.update(exit=rc, secs=round(time.monotonic() - t0, 1))
        return rc

    # -- commands and checks ------------------------------------------------------------
    def ddpkit(self, label: str, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
        """`python -m ddpkit ARGS`: its output into the log and WORK/out/LABEL.txt; the exit code and,
        when it is not 0, what to show of it (the time limit, the last lines)."""
        out, t0, seconds = self.work / "out" / f"{label}.txt", time.monotonic(), self.limit(self.cmd_timeout)
        self.note(f"$ {self.python} -m ddpkit {' '.join(args)}")
        rc = self.timed(seconds, [self.python, "-m", "ddpkit", *args], out, {**os.environ, **(env or {})})
        self.step.commands[-1]["label"] = label
        self.append_log(out)
        self.note(f"(exit {rc} after {int(time.monotonic() - t0)} s)")
        shown = []
        if rc in (124, 137):
            shown.append(f"  {label}: stopped after its time limit ({seconds} s)")
        if rc != 0:
            shown.append(f"  {label}: ddpkit exited {rc}; its last lines:")
            shown += [f"      | {line}" for line in tail(out, 12)]
            for line in shown:
                self.note(line)
        return rc, "\n".join(shown)

    def check(self, desc: str, fn: Callable[..., str | None], *args: Any) -> str | None:
        """Run one check: "ok" with its line, or "FAIL" with why (the step fails); its line, or None."""
        try:
            ok, text = True, (fn(*args) or "")
        except runs.Failed as e:
            ok, text = False, str(e)
        except Exception as e:  # noqa: BLE001 - a check that cannot read what it checks fails
            ok, text = False, f"{type(e).__name__}: {e}"
        text = text.rstrip("\n")
        self.last = text
        self.step.checks.append({"check": desc, "ok": ok, "output": text})
        if ok:
            self.say(f"  ok    {desc}" + (f": {text.replace(chr(10), ' | ')}" if text else ""))
            return text
        self.step.status = "FAIL"
        self.say(f"  FAIL  {desc}")
        for line in text.splitlines():
            self.say(f"        {line}")
        return None

    def runs_check(self, desc: str, name: str, *args: Any) -> str | None:
        """A check of gpu_check_runs.py on run directories."""
        return self.check(desc, getattr(runs, f"cmd_{name}"), *map(str, args))

    def ddpkit_check(self, desc: str, label: str, *args: str, env: dict[str, str] | None = None) -> bool:
        """A ddpkit command whose exit code 0 is itself a check."""

        def exits_0() -> str:
            rc, shown = self.ddpkit(label, *args, env=env)
            if rc != 0:
                raise runs.Failed(shown)
            return ""

        return self.check(desc, exits_0) is not None

    def trained(self, label: str, run: Path, *args: str, env: dict[str, str] | None = None) -> bool:
        """A training run into `run` whose exit code is itself a check."""
        self.step.runs.append(str(run))
        cmd = ("train", *args, "--run-dir", str(run), "--progress", "lines")
        return self.ddpkit_check(f"{label} trains (exit 0)", label, *cmd, env=env)

    def output(self, label: str) -> str:
        return (self.work / "out" / f"{label}.txt").read_text(errors="replace")

    # -- steps and the table ------------------------------------------------------------
    def run_step(self, step_id: str, name: str, fn: Callable[[GpuCheck], None], only: list[str]) -> None:
        if step_id not in only:
            return
        self.step = StepRecord(step_id, name)
        self.steps.append(self.step)
        t0 = time.monotonic()
        if self.elapsed() > self.mode.budget_s:
            budget = self.mode.budget_s
            self.say(f"== step {step_id} {name}: not run, the time budget ({budget} s) is spent")
            self.step.status, self.step.mfu = "FAIL", "-"
            self.step.note = f"not run: time budget of {budget} s spent (GPU_CHECK_BUDGET_S)"
            self.write_record()
            return
        self.say()
        self.say(f"== step {step_id} {name} ({time.strftime('%H:%M:%S')}, {self.elapsed()} s into the run)")
        fn(self)
        if not self.step.mfu and self.step.runs:
            ok, line = runs.run("mfu", *self.step.runs)
            self.step.mfu = line.split(" ")[0] if ok else ""
        self.step.secs = int(time.monotonic() - t0)
        mfu = f", mfu {self.step.mfu}" if self.step.mfu else ""
        self.say(f"== step {step_id} {name}: {self.step.status} ({self.step.secs} s{mfu})")
        self.write_record()

    def table(self) -> str:
        lines = ["", f"{'step':<4} {'name':<11} {'status':<6} {'secs':>5} {'mfu':>8}  note"]
        for s in self.steps:
            lines.append(f"{s.id:<4} {s.name:<11} {s.status:<6} {s.secs:>5} {s.mfu or '-':>8}  {s.note}")
        where = f"{self.ngpu} GPU(s)" if self.mode.name == "gpu" else "CPU"
        return f"gpu_check ({self.mode.name}): torch {self.torch_version} on {where}, {self.elapsed()} s\n" + "\n".join(
            lines
        )

    def write_record(self, exit_code: int | None = None) -> None:
        """gpu_check.json, whole or not at all: every step so far, and the exit code at the end."""
        record = {
            "mode": self.mode.name,
            "torch": self.torch_version,
            "cuda_build": self.torch_cuda,
            "gpus": self.ngpu,
            "python": self.python,
            "budget_s": self.mode.budget_s,
            "hard_s": self.mode.hard_s,
            "seconds": self.elapsed(),
            "exit": exit_code,
            "steps": [{k: v for k, v in vars(s).items() if k != "runs"} for s in self.steps],
        }
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(self.out / "gpu_check.json")


def _stop(proc: subprocess.Popen) -> int:
    """Stop a command's process group: TERM, then KILL 10 s later (as `timeout -k 10`)."""
    for sig, rc in ((signal.SIGTERM, 124), (signal.SIGKILL, 137)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return rc
        try:
            proc.wait(timeout=10)
            return rc
        except subprocess.TimeoutExpired:
            continue
    return 137


def tail(path: Path, n: int) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-n:] if path.is_file() else []
