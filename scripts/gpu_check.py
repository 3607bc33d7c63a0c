#!/usr/bin/env python
"""gpu_check: run and check ddpkit's GPU path on a machine with one GPU (or more), in one go.

  python scripts/gpu_check.py                # on the GPU machine, from anywhere (it works from the repo root)
  python scripts/gpu_check.py --cpu          # the very same steps on CPU (gloo, --device cpu): a dry run
  python scripts/gpu_check.py --steps 2,7    # only some steps (a step that needs the Wine reference runs it)

Nothing is downloaded or installed: ddpkit comes from this checkout (PYTHONPATH=REPO/src),
torch, numpy and scikit-learn from the interpreter that runs this program (`bash
scripts/gpu_check.sh` picks it: $PYTHON if set, else with --cpu this checkout's .venv/bin/python
when it exists, else `python3`). Only ddpkit's CLI is used (`python -m ddpkit env|train`), plus
benchmarks/gpu.py and benchmarks/gpt_mfu.py; the checks (scripts/gpu_check_runs.py) read the run
directories' files (summary.json, model.pt, metrics.jsonl, checkpoints/) with torch alone.

The steps, in the order they run, are STEPS below (described in gpu_check_steps.py; each goes on
after a failed check; the table at the end says which failed):  1 env, 2 train, 3 bf16, 4 fsdp,
5 fused, 6 compile, 7 resume, 7b resume-cnn, 8 bench, 9 fp16, 10 syncdebug, 11 sharegpu and,
last (sized to the time left), 8b gpt. The table has an mfu column: each step's highest model
FLOPs utilisation among its ddpkit runs (summary.json's throughput.mfu; "-" where none has one),
and for 8b ddpkit's compiled row's.

With one process ddpkit starts no process group (summary backend "none", as on CPU): NCCL and
DDP are exercised only with 2+ GPUs (step 4's 2-process runs) and by the hand-written baseline of
step 8 (NCCL with world size 1).

Output: $OUT if set (what comes back from the GPU machine: at most 8 files), else
runs/gpu_check[-cpu]/ of this checkout: gpu_check.log (everything, every benchmark's own logs
merged in), gpu_check_table.txt, gpu_check.json (the record of every step: its status, time,
note, each check with its output and each command with its exit code, written after every step),
env.json, summaries.json, bench.json, gpu.md (the MLP and the GPT tables). Run directories and
other work files go to a temporary folder.
Time: at most 8 minutes on one H100/H200 (GPU_CHECK_HARD_S, 460 s, ends every command; no step
starts after GPU_CHECK_BUDGET_S, 400 s; one ddpkit command at most GPU_CHECK_CMD_TIMEOUT, 240 s).
Exit 0: every step passed; 1: some step failed; 2: cannot run (no GPU without --cpu, no torch).

Determinism (step 7): CUBLAS_WORKSPACE_CONFIG=:4096:8 is exported for every training run unless
already set: the value torch's reproducibility notes named for deterministic cuBLAS (torch 2.11
no longer insists on it, pytorch#161749; cuBLAS is run-to-run reproducible on one stream anyway,
and Wine's Linear layers and Adam use nothing else). Step 7b trains the digits CNN with
--deterministic; if the resumed model still differs, it runs it twice uninterrupted to tell a
resume bug from run-to-run differences that --deterministic failed to remove.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_measure as measure  # noqa: E402
import gpu_check_runs as runs  # noqa: E402
import gpu_check_steps as steps  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STEPS: list[tuple[str, str, Callable[[GpuCheck], None]]] = [
    ("1", "env", steps.step_env),
    ("2", "train", steps.step_train),
    ("3", "bf16", steps.step_bf16),
    ("4", "fsdp", steps.step_fsdp),
    ("5", "fused", steps.step_fused),
    ("6", "compile", steps.step_compile),
    ("7", "resume", steps.step_resume),
    ("7b", "resume-cnn", steps.step_resume_cnn),
    ("8", "bench", measure.step_bench),
    ("9", "fp16", steps.step_fp16),
    ("10", "syncdebug", measure.step_syncdebug),
    ("11", "sharegpu", steps.step_sharegpu),
    ("8b", "gpt", measure.step_gpt),  # last: the measurement that adapts to the time left
]

DEFAULT_STEPS = ",".join(step_id for step_id, _, _ in STEPS)
PROBE = """
import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(torch.__version__, torch.version.cuda or "none", n)"""


def usage() -> str:
    return __doc__.split("\n\nNothing is downloaded")[0]


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


def parse_args(argv: list[str]) -> tuple[str, list[str]]:
    mode, only = "gpu", DEFAULT_STEPS
    args = list(argv)
    while args:
        a = args.pop(0)
        if a == "--cpu":
            mode = "cpu"
        elif a == "--steps":
            if not args:
                print("gpu_check: --steps needs a list, e.g. 2,7", file=sys.stderr)
                sys.exit(2)
            only = args.pop(0)
        elif a in ("-h", "--help"):
            print(usage())
            sys.exit(0)
        else:
            print(f"gpu_check: unknown argument '{a}'", file=sys.stderr)
            print(usage(), file=sys.stderr)
            sys.exit(2)
    return mode, only.split(",")


def probe_torch(say: Callable[[str], None], mode: str) -> tuple[str, str, int]:
    """torch's version, its CUDA build and the GPUs it sees (exit 2 when it cannot run here)."""
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True)
    last = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    if proc.returncode != 0:
        say(f"gpu_check: cannot import torch with {sys.executable}: {last[0]}")
        say("gpu_check: set PYTHON to an interpreter that has torch (no package is installed by this script)")
        sys.exit(2)
    version, cuda, ngpu = last[0].split()
    if mode == "gpu" and int(ngpu) < 1:
        say(f"gpu_check: no CUDA GPU is visible to {sys.executable} (torch {version}, CUDA build: {cuda}).")
        say("gpu_check: this script checks ddpkit's GPU path and needs a GPU; run it on a GPU machine,")
        say("gpu_check: or pass --cpu to run the same steps on the CPU (a dry run of this script).")
        sys.exit(2)
    return version, cuda, int(ngpu)


def set_environment(mode: Mode) -> bool:
    """What every command gets: this checkout's ddpkit, unbuffered output, reproducible cuBLAS
    (set here, not inherited, so that step 8 can leave it out: it measures the defaults), NCCL's
    warnings and, on one node without network, its bootstrap socket on loopback. Returns whether
    CUBLAS_WORKSPACE_CONFIG was set here."""
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))
    os.environ["PYTHONUNBUFFERED"] = "1"
    set_cublas = not os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if set_cublas:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    os.environ["NCCL_DEBUG"] = os.environ.get("NCCL_DEBUG") or "WARN"
    if mode.name == "gpu":
        os.environ["NCCL_SOCKET_IFNAME"] = os.environ.get("NCCL_SOCKET_IFNAME") or "lo"
    return set_cublas


def header(c: GpuCheck) -> None:
    """Where and with what the check runs: the console and the log."""
    m = c.mode
    c.say(f"gpu_check ({m.name}) {time.strftime('%F %T')} on {platform.node() or '?'}: repo {REPO}")
    c.say(
        f"  python {c.python} ({platform.python_version()}), torch {c.torch_version}, CUDA build {c.torch_cuda}, "
        f"GPUs visible {c.ngpu}"
    )
    c.say(f"  output {c.out}, work {c.work}, budget {m.budget_s} s")
    git = lambda *a: subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True).stdout  # noqa: E731
    head = git("rev-parse", "--short", "HEAD").strip() or "no git"
    c.note(f"  git: {head} {len(git('status', '--short').splitlines())} changed files")
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,compute_cap", "--format=csv,noheader"]
        smi = subprocess.run(query, capture_output=True, text=True)
        for line in (smi.stdout + smi.stderr).splitlines():
            c.say(f"  nvidia-smi: {line}")
    env = {k: os.environ.get(k, "") for k in ("CUBLAS_WORKSPACE_CONFIG", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME")}
    env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    c.note("  env: " + " ".join(f"{k}={v}" for k, v in env.items()))
    c.note(f"  packages: {packages()}")


def packages() -> str:
    import importlib.metadata as m

    out = []
    for p in ("numpy", "scikit-learn", "triton", "tqdm"):
        try:
            out.append(f"{p} {m.version(p)}")
        except m.PackageNotFoundError:
            out.append(f"{p} -")
    return ", ".join(out)


def main(argv: list[str]) -> int:
    mode_name, only = parse_args(argv)
    os.chdir(REPO)
    out = Path(os.environ.get("OUT") or REPO / "runs" / ("gpu_check" + ("-cpu" if mode_name == "cpu" else "")))
    out.mkdir(parents=True, exist_ok=True)
    log = out / "gpu_check.log"
    log.write_text("")

    def say(text: str) -> None:
        print(text, flush=True)
        with open(log, "a") as f:
            f.write(text + "\n")

    probe = probe_torch(say, mode_name)
    mode = Mode.of(mode_name, probe[2])
    set_cublas = set_environment(mode)
    work = Path(tempfile.mkdtemp(prefix="ddpkit-gpu-check."))
    (work / "out").mkdir()
    (work / "runs").mkdir()
    c = GpuCheck(mode, out, log, work, probe)
    c.set_cublas = set_cublas
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped check stops its command's group too
    header(c)
    for step_id, name, fn in STEPS:
        c.run_step(step_id, name, fn, only)
    runs.run("collect", str(out / "summaries.json"), *sorted(str(p) for p in c.runs_dir.iterdir()))
    table = c.table()
    (out / "gpu_check_table.txt").write_text(table + "\n")
    c.say()
    c.say(table)
    failed = any(s.status != "PASS" for s in c.steps)
    c.write_record(1 if failed else 0)
    if not failed:
        c.say(f"gpu_check: every step passed ({c.elapsed()} s); log: {log}")
        shutil.rmtree(work, ignore_errors=True)
        return 0
    c.say(f"gpu_check: some step FAILED (see above and {log}); run directories kept in {work}")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
