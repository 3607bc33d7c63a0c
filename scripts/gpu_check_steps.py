"""scripts/gpu_check.py's steps (its STEPS, in the order they run): the training steps here, the
measurements (8 bench, 10 syncdebug, 8b gpt) in gpu_check_measure.py, with the checks both use.
Each takes the check's state (c: gpu_check.GpuCheck) and goes on after a failed check; with --cpu
each runs its CPU stand-in.

   1 env       ddpkit env: CUDA device, NCCL, the plan (nccl + cuda)
   2 train     Wine (100 epochs) and digits (8 epochs) with --nproc 1: device cuda:0, the CPU
               tests' accuracy thresholds (>= 0.97, >= 0.95), the run contract; Wine again
               through torch's elastic agent (--max-restarts 1: a spawned worker, the path of
               multi-GPU runs), equal to the in-process run
   3 bf16      --precision bf16 (autocast) trains, accuracy within 0.05 of fp32 (refused where
               the hardware has no native bfloat16, which is then what is checked)
   4 fsdp      --strategy fsdp with one process is refused (exit 2, one line); with 2 or more
               devices (2 GPUs, or --cpu) FSDP2 on 2 processes trains, model.pt loads, equals DDP
   5 fused     the default (--fused-optimizer auto) fused the optimizer on the GPU (summary
               fused_optimizer; not on a CPU); --fused-optimizer off trains, close to it
   6 compile   --compile trains, close to eager
   7 resume    50 epochs, then --resume --epochs 100: model.pt bit-identical to 100 straight
               epochs (torch.equal on every tensor), same per-epoch losses
   7b resume-cnn  the same for the digits CNN (cuDNN convolutions) under --deterministic (summary
               deterministic true), with a control run when it differs
   8 bench     benchmarks/gpu.py: the MLP, hand-written DDP vs ddpkit, fp32 and bf16, samples/s
               -> benchmarks/results/gpu.md (with --cpu: only into the output folder)
   9 fp16      --precision fp16 (autocast + gradient scaler) trains, accuracy within 0.05 of
               fp32, and 50 epochs + --resume is bit-identical to 100 (the scaler's state is in
               the checkpoint); with --cpu its refusal is what is checked
  10 syncdebug scripts/sync_check.py: ddpkit's optimizer steps (--accumulate 2, batches copied
               ahead by training/prefetch.py, then batches of a data set kept on the device over
               two passes, the default fused AdamW) under torch.cuda.set_sync_debug_mode("error"):
               fails on any host synchronisation inside a step; none is allowed (0 a step: the
               device skips a non-finite step, the host reads the agreement a step later; with
               --cpu: the same steps, no debug mode)
  11 sharegpu  DDPKIT_SHARE_GPU=1: 2 ranks share cuda:0 over gloo: DDP and FSDP2 (CUDA DTensors) on
               2 ranks end at a 1-rank run; FSDP's sharded checkpoint of CUDA tensors holds every
               rank's CUDA RNG state and resumes at world 1 to the 1-rank run (with --cpu: the same
               runs on CPU ranks). Not proved: NCCL itself, P2P/NVLink, multi-GPU bandwidth
  12 tp        (only with --steps 12) DDPKIT_SHARE_GPU=1: a 2x2 mesh (dp_shard x tp) on 4 ranks
               sharing cuda:0 trains examples/tp_gpt.py; benchmarks/tp_fsdp.py: its tokens/s
               beside FSDP over the 4 ranks -> tp_fsdp.md (gpu_check_measure.py)
  8b gpt       benchmarks/gpt_mfu.py: GPT-2 small (block 256) in ddpkit and a hand-written loop,
               bf16 + torch.compile + fused AdamW, with each row's MFU; run last, sized to the
               time left: the fp32 eager rows too when there is time, the compiled rows left
               uncompiled when there is not (with --cpu: a tiny GPT's bf16 rows, uncompiled, MFU
               against a nominal peak of GPU_CHECK_CPU_PEAK_TFLOPS, 1 by default: the wiring, not
               a measurement). Its table goes into gpu.md
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import gpu_check_runs as runs

if TYPE_CHECKING:
    from gpu_check_core import GpuCheck

COMPILE_TROUBLE = re.compile(
    r"Python\.h|stddef\.h|C compiler|[Tt]riton (installation )?not found|No module named 'triton'|BackendCompilerFailed"
)


# -- what the steps share ---------------------------------------------------------------
def device_flags(c: GpuCheck) -> list[str]:
    return ["--nproc", "1", "--device", c.mode.dev, "--backend", c.mode.backend]


def wine(c: GpuCheck) -> list[str]:
    """The CPU tests' default job (100 epochs, batch 32)."""
    return ["wine", *device_flags(c), "--epochs", "100", "--seed", "0"]


def digits(c: GpuCheck) -> list[str]:
    """test_digits.py's 1-process run."""
    return ["digits", *device_flags(c), "--epochs", "8", "--seed", "0", "--batch-size", "64", "--save-every", "0"]


def run_dir(c: GpuCheck, name: str) -> Path:
    return c.runs_dir / name


def before(text: str, sep: str = "(") -> str:
    """What a check's line says before `sep` (its figure, without the allowance)."""
    return text.split(sep, 1)[0]


def found(c: GpuCheck, label: str, pattern: str) -> Callable[[], str]:
    """A check: `pattern` (a grep pattern: . and * as in regular expressions, the rest literal) in
    the output of the command `label`."""
    regex = re.escape(pattern).replace(r"\.", ".").replace(r"\*", "*")

    def check() -> str:
        if not re.search(regex, c.output(label)):
            raise runs.Failed(f"'{pattern}' not in the output of {label}")
        return ""

    return check


def no_traceback(c: GpuCheck, label: str) -> Callable[[], str]:
    def check() -> str:
        if "Traceback" in c.output(label):
            raise runs.Failed(f"a traceback in the output of {label}")
        return ""

    return check


def exit_code_is(c: GpuCheck, want: int, label: str, *args: str) -> Callable[[], str]:
    """A check: `ddpkit ARGS` exits `want`; its line is the command's first error line."""

    def check() -> str:
        rc, _ = c.ddpkit(label, *args)
        if rc != want:
            raise runs.Failed("\n".join([f"exit {rc}, expected {want}", *c.output(label).splitlines()[-5:]]))
        first = next((line for line in c.output(label).splitlines() if "ddpkit: error" in line or "error:" in line), "")
        return f"exit {rc}: {first[:160]}"

    return check


def holds(condition: bool, why: str = "") -> Callable[[], str]:
    def check() -> str:
        if not condition:
            raise runs.Failed(why)
        return ""

    return check


def wine_ref(c: GpuCheck) -> None:
    """The fp32 Wine reference of steps 3, 5, 6, 7 (step 2 makes it; made here when step 2 is skipped)."""
    ref = run_dir(c, "wine-fp32")
    if (ref / "model.pt").is_file():
        return
    c.say("  (making the fp32 Wine reference run)")
    c.ddpkit("wine-fp32", "train", *wine(c), "--run-dir", str(ref), "--progress", "lines")


# -- the steps ----------------------------------------------------------------------------
def step_env(c: GpuCheck) -> None:
    c.ddpkit_check("ddpkit env exits 0", "env-text", "env")
    if c.ddpkit("env-json", "env", "--json")[0] == 0:
        shutil.copy(c.work / "out" / "env-json.txt", c.out / "env.json")
    line = c.runs_check("ddpkit env --json: device, backend, versions", "env", c.out / "env.json", c.mode.name)
    if line is not None:
        c.add_note(";".join(line.split(";")[:2]))
    text = c.output("env-text").splitlines()
    start = next((i for i, s in enumerate(text) if s.startswith("warnings")), len(text))
    for s in text[start:]:
        print(f"  env: {s}", flush=True)


def step_train(c: GpuCheck) -> None:
    r, dev = run_dir(c, "wine-fp32"), c.mode.expect_device
    if c.trained("wine-fp32", r, *wine(c)):
        c.runs_check(
            f"summary: one process on {dev}, accuracy >= 0.97", "summary", r, "world_size=1", "backend=none",
            f"device={dev}", "strategy=ddp", "precision=fp32", "epochs_done=100", "eval_accuracy>=0.97",
            "data=on device",
        )  # fmt: skip
        c.check(
            "printed summary names the device",
            found(c, "wine-fp32", f"world size   1 (1 node), backend none, device {dev}"),
        )
        c.runs_check("model.pt: plain state_dict, loads into Linear(13,64)-ReLU-Linear(64,3)", "model", r, "wine")
        c.runs_check("checkpoints at epochs 50 and 100", "ckpts", r, "epoch-000050.pt", "epoch-000100.pt")
        c.runs_check(f"peak memory measured on every rank ({c.mode.peak_kind})", "peak", r, c.mode.peak_kind)
    # the spawned-worker path (torch's elastic agent; what every multi-GPU run takes)
    agent = run_dir(c, "wine-agent")
    if c.trained("wine-agent", agent, *wine(c), "--save-every", "0", "--max-restarts", "1"):
        c.runs_check(
            f"elastic-agent worker: {dev}, accuracy >= 0.97", "summary", agent, "world_size=1", f"device={dev}",
            "eval_accuracy>=0.97",
        )  # fmt: skip
        if (r / "model.pt").is_file():
            c.runs_check("elastic-agent run equals the in-process run", "close", agent, r, 0, 1e-6)
    d = run_dir(c, "digits-fp32")
    if c.trained("digits-fp32", d, *digits(c)):
        c.runs_check(
            f"digits summary: {dev}, accuracy >= 0.95", "summary", d, "world_size=1", f"device={dev}", "epochs_done=8",
            "eval_accuracy>=0.95",
        )  # fmt: skip
        c.runs_check("digits model.pt loads into the CNN", "model", d, "digits")
    if (r / "summary.json").is_file():
        _, line = runs.run("summary", str(r))
        fields = line.split(",")
        c.add_note(",".join(fields[i] for i in (2, 6) if i < len(fields)).lstrip(" ") if len(fields) > 1 else line)
    if c.mode.name == "gpu":
        c.add_note("1 process: no process group (backend none), NCCL unused")


def step_bf16(c: GpuCheck) -> None:
    has = subprocess.run(
        [c.python, str(Path(runs.__file__)), "bf16", c.mode.name], capture_output=True, text=True
    )  # in a process of its own: asking the GPU starts CUDA
    if (has.stdout + has.stderr).strip() != "yes":
        c.add_note("no native bfloat16 here: the refusal is checked")
        args = (
            "train",
            *wine(c),
            "--precision",
            "bf16",
            "--save-every",
            "0",
            "--run-dir",
            str(run_dir(c, "wine-bf16")),
        )
        c.check("--precision bf16 refused with exit 2 and one line", exit_code_is(c, 2, "wine-bf16", *args))
        c.check("the refusal names bfloat16", found(c, "wine-bf16", "--precision bf16: this"))
        c.check("no traceback", no_traceback(c, "wine-bf16"))
        return
    wine_ref(c)
    ref, b = run_dir(c, "wine-fp32"), run_dir(c, "wine-bf16")
    if c.trained("wine-bf16", b, *wine(c), "--precision", "bf16", "--save-every", "0"):
        c.runs_check(
            "wine bf16: precision bf16, accuracy >= 0.97", "summary", b, "precision=bf16",
            f"device={c.mode.expect_device}", "eval_accuracy>=0.97",
        )  # fmt: skip
        c.runs_check("wine bf16 accuracy within 0.05 of fp32", "acc_close", b, ref, 0.05)
        line = c.runs_check("wine bf16 weights close to fp32 (bf16 rounding, same training)", "close", b, ref, 0, 0.1)
        if line is not None:
            c.add_note(f"weights {before(line)}vs fp32")
    d, db = run_dir(c, "digits-fp32"), run_dir(c, "digits-bf16")
    if not (d / "model.pt").is_file():
        c.ddpkit("digits-fp32", "train", *digits(c), "--run-dir", str(d))
    if c.trained("digits-bf16", db, *digits(c), "--precision", "bf16"):
        c.runs_check("digits bf16: accuracy >= 0.95", "summary", db, "precision=bf16", "eval_accuracy>=0.95")
        c.runs_check("digits bf16 accuracy within 0.05 of fp32", "acc_close", db, d, 0.05)


def step_fsdp(c: GpuCheck) -> None:
    one = run_dir(c, "fsdp-1")
    args = ("train", "wine", *device_flags(c), "--strategy", "fsdp", "--epochs", "1", "--run-dir", str(one))
    c.check("--strategy fsdp with one process: exit 2, one line", exit_code_is(c, 2, "fsdp-1", *args))
    c.check("the refusal says it needs 2 processes", found(c, "fsdp-1", "needs at least 2"))
    clean = "Traceback" not in c.output("fsdp-1") and not (one / "model.pt").exists()
    c.check("no traceback, no model.pt", holds(clean))
    if c.mode.ndev < 2:
        c.add_note("1 GPU: FSDP needs 2 processes, one per GPU, so FSDP2 itself is not exercised (refusal checked)")
        return
    m = c.mode
    common = ["wine", "--nproc", "2", "--device", m.dev, "--backend", m.backend, "--epochs", "20", "--seed", "0"]
    common += ["--save-every", "10"]
    sync = "nccl" if m.name == "gpu" else "shm"
    ddp, fsdp = run_dir(c, "ddp-2"), run_dir(c, "fsdp-2")
    if c.trained("ddp-2", ddp, *common):
        c.runs_check(
            f"DDP on 2 processes: backend {m.backend}, gradients by {sync}", "summary", ddp, "world_size=2",
            f"backend={m.backend}", f"grad_sync={sync}", "strategy=ddp",
        )  # fmt: skip
    if c.trained("fsdp-2", fsdp, *common, "--strategy", "fsdp"):
        c.runs_check(
            f"FSDP on 2 processes: backend {m.backend}", "summary", fsdp, "world_size=2", f"backend={m.backend}",
            "strategy=fsdp",
        )  # fmt: skip
        c.runs_check("FSDP model.pt: consolidated, loads into the Wine model", "model", fsdp, "wine")
        c.runs_check("sharded checkpoints at epochs 10 and 20", "ckpts", fsdp, "epoch-000010", "epoch-000020")
        if (ddp / "model.pt").is_file():
            desc = "FSDP ends at DDP's parameters (1e-5/1e-6, as tests/distributed/test_fsdp.py)"
            c.runs_check(desc, "close", fsdp, ddp, 1e-5, 1e-6)
    c.add_note(f"FSDP2 and DDP on 2 processes ({m.backend})")


def step_fused(c: GpuCheck) -> None:
    wine_ref(c)
    ref, off = run_dir(c, "wine-fp32"), run_dir(c, "wine-unfused")
    fused = "true" if c.mode.name == "gpu" else "false"  # --fused-optimizer auto: GPUs only
    desc = f"--fused-optimizer auto (the default): fused_optimizer {fused} (fused on a GPU only)"
    c.runs_check(desc, "summary", ref, f"fused_optimizer={fused}")
    if c.trained("wine-unfused", off, *wine(c), "--fused-optimizer", "off", "--save-every", "0"):
        desc = "--fused-optimizer off: not fused, accuracy >= 0.97"
        c.runs_check(desc, "summary", off, "fused_optimizer=false", "eval_accuracy>=0.97")
        c.runs_check("fused (the default) close to unfused after 100 epochs", "close", ref, off, 1e-4, 1e-5)
        c.add_note(f"{before(c.last)}vs unfused")


def step_compile(c: GpuCheck) -> None:
    wine_ref(c)
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang") or "none"
    c.note(f"C compiler (inductor/triton need one): {cc}")
    run, ref = run_dir(c, "wine-compile"), run_dir(c, "wine-fp32")
    if c.trained("wine-compile", run, *wine(c), "--compile", "--save-every", "0"):
        desc = "compiled: accuracy >= 0.97"
        c.runs_check(desc, "summary", run, f"device={c.mode.expect_device}", "eval_accuracy>=0.97")
        took = re.search(r"train [0-9.]* s", c.last)
        c.runs_check("compiled close to eager after 100 epochs", "close", run, ref, 1e-3, 1e-4)
        took_s = took.group(0)[len("train ") :] if took else ""
        c.add_note(f"{before(c.last)}vs eager; {took_s} of training, compilation included")
        return
    if cc == "none":
        c.add_note("no C compiler on PATH: inductor/triton need one")
    # what torch.compile on a GPU needs besides torch: triton, and a C compiler with Python's headers
    # (triton builds its launcher with them); name the first such complaint
    c.add_note(next((line[:200] for line in c.output("wine-compile").splitlines() if COMPILE_TROUBLE.search(line)), ""))


def step_resume(c: GpuCheck) -> None:
    wine_ref(c)
    r, ref = run_dir(c, "wine-split"), run_dir(c, "wine-fp32")
    if not c.trained("wine-half", r, *wine(c), "--epochs", "50"):
        return
    if c.trained("wine-resume", r, *wine(c), "--resume"):
        c.check("resumed from the epoch-50 checkpoint", found(c, "wine-resume", "resuming from .*epoch-000050.pt"))
        c.runs_check("model.pt bit-identical to 100 uninterrupted epochs", "equal", r, ref)
        c.runs_check("per-epoch train/eval losses identical", "metrics_equal", r, ref)
    c.add_note(f"CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']}")


def step_resume_cnn(c: GpuCheck) -> None:
    common = ["digits", *device_flags(c), "--epochs", "4", "--seed", "0", "--batch-size", "64", "--save-every", "2",
              "--deterministic"]  # fmt: skip
    full, split, full2 = run_dir(c, "cnn-full"), run_dir(c, "cnn-split"), run_dir(c, "cnn-full2")
    for label, run, more in (
        ("cnn-full", full, []),
        ("cnn-half", split, ["--epochs", "2"]),
        ("cnn-resume", split, ["--resume"]),
    ):
        if not c.trained(label, run, *common, *more):
            return
    c.runs_check("--deterministic recorded in the summary", "summary", split, "deterministic=true")
    c.add_note("digits CNN --deterministic: 2 epochs + --resume to 4 vs 4")
    if runs.run("equal", str(split), str(full))[0]:
        c.runs_check("CNN resumed model.pt bit-identical to 4 uninterrupted epochs", "equal", split, full)
        return
    # not equal: is the CNN reproducible at all here (two uninterrupted runs)?
    if not c.trained("cnn-full2", full2, *common):
        return
    if runs.run("equal", str(full2), str(full))[0]:
        desc = "CNN resumed model.pt bit-identical (uninterrupted runs are reproducible here, so resume broke it)"
        c.runs_check(desc, "equal", split, full)
    else:
        c.runs_check("CNN resumed model.pt bit-identical", "equal", split, full)
        c.add_note(
            "two uninterrupted CNN runs differ too, under --deterministic: a kernel it did not make deterministic"
        )


def step_fp16(c: GpuCheck) -> None:
    fp16, ref = run_dir(c, "wine-fp16"), run_dir(c, "wine-fp32")
    if c.mode.name == "cpu":
        args = ("train", *wine(c), "--precision", "fp16", "--save-every", "0", "--run-dir", str(fp16))
        c.check("--precision fp16 refused on a CPU with exit 2", exit_code_is(c, 2, "wine-fp16", *args))
        c.check("the refusal names the GPU it needs", found(c, "wine-fp16", "--precision fp16 needs a CUDA GPU"))
        c.check("no traceback", no_traceback(c, "wine-fp16"))
        c.add_note("CPU: the refusal is checked")
        return
    wine_ref(c)
    if c.trained("wine-fp16", fp16, *wine(c), "--precision", "fp16"):
        c.runs_check(
            "wine fp16: precision fp16, accuracy >= 0.97", "summary", fp16, "precision=fp16",
            f"device={c.mode.expect_device}", "eval_accuracy>=0.97",
        )  # fmt: skip
        c.runs_check("wine fp16 accuracy within 0.05 of fp32", "acc_close", fp16, ref, 0.05)
    r = run_dir(c, "wine-fp16-split")
    if not c.trained("wine-fp16-half", r, *wine(c), "--precision", "fp16", "--epochs", "50"):
        return
    if c.trained("wine-fp16-resume", r, *wine(c), "--precision", "fp16", "--resume"):
        desc = "fp16 resumed model.pt bit-identical to 100 uninterrupted epochs (scaler state restored)"
        c.runs_check(desc, "equal", r, fp16)


def step_sharegpu(c: GpuCheck) -> None:
    """The multi-rank CUDA paths on one GPU: ranks share it over gloo (collectives staged through host
    memory), which NCCL refuses. What this cannot prove: NCCL itself (its kernels, algorithms,
    watchdog), GPU-to-GPU P2P/NVLink, real multi-GPU bandwidth and overlap, one GPU per rank."""
    s, dev, share = run_dir(c, "share"), c.mode.expect_device, {"DDPKIT_SHARE_GPU": "1"}
    g = ["wine", "--device", c.mode.dev, "--global-batch-size", "64", "--seed", "0"]
    one = [*g, "--nproc", "1", "--epochs", "20", "--save-every", "0"]
    if not c.trained("share-1", s / "one", *one):
        return
    if c.trained("share-ddp", s / "ddp", *g, "--nproc", "2", "--epochs", "20", "--save-every", "0", env=share):
        desc = f"DDP, 2 ranks on {dev} over gloo"
        c.runs_check(desc, "summary", s / "ddp", "world_size=2", "backend=gloo", f"device={dev}", "strategy=ddp")
        line = c.runs_check("DDP on 2 shared ranks ends at the 1-rank run", "close", s / "ddp", s / "one", 1e-5, 1e-6)
        if line is not None:
            c.add_note(f"DDP {before(line)}")
    fsdp = ["--nproc", "2", "--strategy", "fsdp", "--epochs", "10", "--save-every", "10"]
    if not c.trained("share-fsdp", s / "fsdp", *g, *fsdp, env=share):
        return
    desc = f"FSDP2, 2 ranks on {dev} over gloo"
    c.runs_check(desc, "summary", s / "fsdp", "world_size=2", "backend=gloo", f"device={dev}", "strategy=fsdp")
    if c.mode.name == "gpu":
        c.check("rank 0 says the ranks share the GPU", found(c, "share-fsdp", "2 ranks share 1 GPU(s) over gloo"))
    desc = "sharded checkpoint: a shard per rank, every rank's RNG state (CUDA's on a GPU)"
    c.runs_check(desc, "shards", s / "fsdp" / "checkpoints" / "epoch-000010", c.mode.name)
    if c.trained("share-resume", s / "fsdp", *one, "--resume"):
        c.check(
            "resumed at world 1 from the 2-rank sharded checkpoint",
            found(c, "share-resume", "resuming from .*epoch-000010"),
        )
        desc = "FSDP 10 epochs on 2 shared ranks + 10 resumed on 1 ends at the 1-rank run"
        line = c.runs_check(desc, "close", s / "fsdp", s / "one", 1e-5, 1e-6)
        if line is not None:
            c.add_note(f"FSDP+resume {before(line)}")
    c.add_note(f"gloo on {dev}; NCCL, P2P and multi-GPU bandwidth not exercised")
