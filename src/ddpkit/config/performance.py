"""DDP's knobs: micro-batches, gradient compression and sync, buckets, fused optimizers,
torch.compile (strategies/ddp_knobs.py; what each changes in the result: docs/performance.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import DdpkitError
from .settings import PERFORMANCE, Section, choice, positive, setting

GRAD_SYNC_MODES = ("auto", "shm", "backend")  # how DDP gradients are all-reduced (strategies/grad_sync.py)
GRAD_COMPRESSIONS = ("none", "bf16", "fp16", "powersgd")
FUSED_MODES = ("off", "on", "auto")
CPU_ALLOCATORS = ("auto", "release", "keep")  # runtime/allocator.py


@dataclass(frozen=True)
class Performance(Section):
    """How DDP computes and reduces the gradients: the same result, at another speed (or precision)."""

    GROUP = PERFORMANCE

    # performance knobs (strategies/ddp_knobs.py): what each changes in the result is documented there
    accumulate: int = setting(
        1,
        "K micro-batches of --batch-size per optimizer step, gradients all-reduced once (no_sync on the "
        "others); equals --batch-size K*b",
        group=PERFORMANCE,
        metavar="K",
    )
    grad_compression: str = setting(
        "none",
        "all-reduce gradients in 16 bits, or low-rank PowerSGD: less traffic, close but not equal results",
        group=PERFORMANCE,
        choices=GRAD_COMPRESSIONS,
    )
    grad_sync: str = setting(
        "auto",
        "how gradients are all-reduced: shm (shared memory, ranks on one machine's CPUs), backend "
        "(gloo/NCCL), auto: shm where it applies (CPU, one node), else the backend",
        group=PERFORMANCE,
        choices=GRAD_SYNC_MODES,
    )
    bucket_mb: float | None = setting(
        None, "DDP gradient bucket size in MB", group=PERFORMANCE, type=float, default_help="torch's 25"
    )
    static_graph: bool = setting(
        False, "tell DDP the model uses the same parameters every step (skips per-step graph checks)", group=PERFORMANCE
    )
    fused_optimizer: str = setting(
        "auto",
        "rebuild torch Adam/AdamW/SGD with fused=True (one kernel over all parameters); auto: on a GPU, "
        "where the task left fused and foreach unset; the summary says which ran",
        group=PERFORMANCE,
        choices=FUSED_MODES,
    )
    compile: bool = setting(
        False, "torch.compile the model (slow first steps; needs a C++ compiler on CPU)", group=PERFORMANCE
    )
    deterministic: bool = setting(
        False,
        "deterministic kernels only (cuDNN without benchmark mode, torch.use_deterministic_algorithms, "
        "CUBLAS_WORKSPACE_CONFIG=:4096:8): a run and its resume repeat bit for bit on a GPU too, at some cost "
        "in speed; an op with no deterministic kernel raises, naming itself",
        group=PERFORMANCE,
    )

    cpu_allocator: str = setting(
        "auto",
        "on a CPU, whether the workers hand freed memory back to the system (release: the peak is what the "
        "memory plan counts, a quarter fewer samples/s at worst) or keep it for reuse (glibc's default: "
        "faster, a peak up to 1.5x the plan's)",
        group=PERFORMANCE,
        choices=CPU_ALLOCATORS,
        default_help="auto: release when the run is sized to its memory (--strategy auto or --device-memory), "
        "else keep",
    )
    peak_tflops: float | None = setting(
        None,
        "the peak TFLOP/s of one device at the run's precision, for the MFU the run reports (achieved TFLOP/s "
        "per device / this)",
        group=PERFORMANCE,
        type=float,
        metavar="TFLOPS",
        default_help="a GPU's dense figure from ddpkit's table (reporting/throughput.py); none on a CPU: no MFU",
    )

    def check(self) -> None:
        choice("--cpu-allocator", self.cpu_allocator, CPU_ALLOCATORS)
        choice("--grad-compression", self.grad_compression, GRAD_COMPRESSIONS)
        choice("--fused-optimizer", self.fused_optimizer, FUSED_MODES)
        choice("--grad-sync", self.grad_sync, GRAD_SYNC_MODES)
        if self.grad_sync == "shm" and self.grad_compression != "none":
            raise DdpkitError(
                f"--grad-sync shm sums float32 gradients in shared memory; it cannot carry --grad-compression "
                f"{self.grad_compression}. Drop one of them (--grad-sync auto picks the backend when compressing)"
            )
        positive("--accumulate", self.accumulate)
        if self.bucket_mb is not None and not (isinstance(self.bucket_mb, (int, float)) and self.bucket_mb > 0):
            raise DdpkitError(f"--bucket-mb must be a positive number of megabytes, got {self.bucket_mb!r}")
        if self.peak_tflops is not None and not (
            isinstance(self.peak_tflops, (int, float))
            and not isinstance(self.peak_tflops, bool)
            and self.peak_tflops > 0
        ):
            raise DdpkitError(
                f"--peak-tflops must be a positive number of TFLOP/s (one device's peak), got {self.peak_tflops!r}"
            )
