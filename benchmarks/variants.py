"""The variants benchmarks/run.py runs: each workload's commands (the guide's scripts, a
hand-written DDP loop, Accelerate, Fabric, ddpkit) and how each workload is judged."""

from __future__ import annotations

from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent

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
