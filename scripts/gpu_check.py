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
last (sized to the time left), 8b gpt; 12 tp (a 2x2 FSDP x TP mesh on 4 shared ranks and
benchmarks/tp_fsdp.py) only when named: `--steps 12`. The table has an mfu column: each step's highest model
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

import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_measure as measure  # noqa: E402
import gpu_check_runs as runs  # noqa: E402
import gpu_check_steps as steps  # noqa: E402
from gpu_check_core import REPO, GpuCheck, Mode  # noqa: E402

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
    ("12", "tp", measure.step_tp),  # opt-in (OPT_IN): --steps 12
    ("8b", "gpt", measure.step_gpt),  # last: the measurement that adapts to the time left
]
OPT_IN = ("12",)  # steps run only when --steps names them: past the default check's 8 minutes

DEFAULT_STEPS = ",".join(step_id for step_id, _, _ in STEPS if step_id not in OPT_IN)
PROBE = """
import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(torch.__version__, torch.version.cuda or "none", n)"""


def usage() -> str:
    return __doc__.split("\n\nNothing is downloaded")[0]


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
