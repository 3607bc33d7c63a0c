"""The performance doctor: up to three things to try after a run (and in `ddpkit bench`), each
with the measurement behind it.

A pure function of what was measured (Measured: the step's split from the time ledger or the
benchmark, the GPU-busy share, the peak memory against the device's, the activations per sample,
the settings that ran). A rule fires only when its measurement is there and past its threshold
(the constants below), and never names a setting that was already on: on a CPU, where no GPU-busy
share or device memory is measured, those rules stay silent. Advice that would change what the
run computes (a larger batch, accumulation that grows it) says so. A job whose training holds a
small part of its wall (TRAINING_SHARE) gets no advice on its steps, only what holds the wall.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..config.values import format_bytes

MAX_ADVICE = 3
HOST_BOUND_BUSY = 0.60  # GPU busy below this share of the training time: the host is the limit
DATA_SHARE = 0.15  # waiting for batches above this share of the step: more loader workers
OPTIMIZER_SHARE = 0.10  # the optimizer above this share of the step: a fused kernel
SYNC_SHARE = 0.20  # exposed gradient sync above this share of the step: fewer syncs
MEMORY_USED = 0.50  # a peak below this share of the device leaves room for a larger batch
FIT_FRACTION = 0.9  # of the device, the most a suggested batch may reach (strategies/choice.py's margin)
MIN_MEASURED_S = 1.0  # a run's steps must hold this many seconds for their split to count
MAX_WORKERS = 8  # the most loader workers suggested per process
TRAINING_SHARE = 0.25  # the steps below this share of the wall: what holds the rest is the advice
FUSABLE = ("Adam", "AdamW", "SGD")  # torch optimizers --fused-optimizer rebuilds


@dataclass
class Measured:
    """What the doctor reads; None where it was not measured. Seconds are sums over the steps."""

    data_s: float | None = None
    compute_s: float | None = None
    grad_sync_s: float | None = None
    optimizer_s: float | None = None
    gpu_busy: float | None = None  # the driver's kernel-running share while training (0..1)
    peak_bytes: int | None = None  # the largest rank's peak
    device_bytes: int | None = None  # a GPU's memory (None on a CPU)
    activation_bytes_per_sample: float | None = None
    batch_size: int | None = None  # per micro-batch (None where --global-batch-size fixes the shares)
    world_size: int = 1
    accumulate: int = 1
    compile: bool | None = None  # None: not a setting of what ran (bench)
    fused_optimizer: bool | None = None
    optimizer: str | None = None  # the optimizer's class name
    num_workers: int | None = None  # None: the loader's workers do not apply (tensors, bench)
    cores_per_process: int | None = None
    global_batch_fixed: bool = False  # --global-batch-size: --accumulate keeps the batch
    wall_s: float | None = None  # the run's wall, from the launch
    training_s: float | None = None  # the steps' seconds (their parts' sum), however few
    outside_s: dict[str, float] = field(default_factory=dict)  # the wall's other parts (startup, eval, other...)

    def step_s(self) -> float | None:
        parts = [self.data_s, self.compute_s, self.grad_sync_s, self.optimizer_s]
        known = [p for p in parts if p is not None]
        return sum(known) if known and sum(known) > 0 else None

    def share(self, part: float | None) -> float | None:
        step = self.step_s()
        return None if part is None or step is None else part / step


def advise(m: Measured) -> list[str]:
    """At most MAX_ADVICE lines, the largest measured loss first; each names its number."""
    dominated = _training_small(m)
    if dominated is not None:
        return [dominated]
    found = [rule(m) for rule in (_host_bound, _data_wait, _optimizer, _grad_sync)]
    lines = [line for _, line in sorted((f for f in found if f is not None), key=lambda f: -f[0])]
    memory = _memory(m)
    if memory is not None:
        lines.append(memory)
    return lines[:MAX_ADVICE]


def _pct(share: float) -> str:
    return f"{100 * share:.0f}%"


def _training_small(m: Measured) -> str | None:
    """The steps hold a small share of the wall: nothing about them would change it much."""
    if m.wall_s is None or m.training_s is None or not m.outside_s or m.wall_s <= 0:
        return None
    share = m.training_s / m.wall_s
    if share >= TRAINING_SHARE:
        return None
    part, seconds = max(m.outside_s.items(), key=lambda kv: kv[1])
    what = {"startup": "start-up (imports, workers, process group, the task's build)"}.get(part, part.replace("_", " "))
    return (
        f"training {_pct(share)} of the wall ({m.training_s:.2f} s of {m.wall_s:.2f} s): {what} holds "
        f"{_pct(seconds / m.wall_s)} ({seconds:.2f} s); no setting of the steps would change the wall much"
    )


def _host_bound(m: Measured) -> tuple[float, str] | None:
    if m.gpu_busy is None or m.gpu_busy >= HOST_BOUND_BUSY or m.compile is not False:
        return None
    return 1.0 - m.gpu_busy, (
        f"GPU busy {_pct(m.gpu_busy)} of the training time: the host is the limit; try --compile "
        "(fewer, larger kernels)"
    )


def _data_wait(m: Measured) -> tuple[float, str] | None:
    share = m.share(m.data_s)
    if share is None or share < DATA_SHARE or m.num_workers is None:
        return None
    most = min(MAX_WORKERS, m.cores_per_process or MAX_WORKERS)
    workers = min(most, max(2, 2 * m.num_workers))
    if workers <= m.num_workers:
        return None
    return share, f"data wait {_pct(share)} of the step: --num-workers {workers} (it ran with {m.num_workers})"


def _optimizer(m: Measured) -> tuple[float, str] | None:
    share = m.share(m.optimizer_s)
    if share is None or share < OPTIMIZER_SHARE or m.fused_optimizer is not False or m.optimizer not in FUSABLE:
        return None
    return share, f"optimizer {_pct(share)} of the step: --fused-optimizer on (one kernel for {m.optimizer})"


def _grad_sync(m: Measured) -> tuple[float, str] | None:
    share = m.share(m.grad_sync_s)
    if share is None or share < SYNC_SHARE or m.world_size < 2:
        return None
    k = 2 * m.accumulate
    if m.global_batch_fixed:
        keeps = "the global batch stays, each micro-batch halves"
    elif m.batch_size is not None:
        g = m.batch_size * m.world_size * m.accumulate
        keeps = f"a 2x batch, which changes the results; --global-batch-size {g} with it keeps them"
    else:
        keeps = "a 2x batch, which changes the results"
    return share, f"gradient sync {_pct(share)} of the step (exposed): --accumulate {k} (half the syncs; {keeps})"


def _memory(m: Measured) -> str | None:
    """A larger batch where the device is mostly empty: what fits, from the activations measured per sample."""
    if None in (m.peak_bytes, m.device_bytes, m.activation_bytes_per_sample, m.batch_size):
        return None
    peak, device, per_sample, batch = m.peak_bytes, m.device_bytes, m.activation_bytes_per_sample, m.batch_size
    assert peak is not None and device is not None and per_sample is not None and batch is not None
    if not device or peak >= MEMORY_USED * device or per_sample <= 0:
        return None
    extra = (FIT_FRACTION * device - peak) / per_sample  # samples more per micro-batch
    doublings = int(math.log2((batch + extra) / batch)) if extra > 0 else 0
    if doublings < 1:
        return None
    bigger = batch * 2**doublings
    return (
        f"{format_bytes(peak)} of {format_bytes(device)} used: --batch-size {bigger} fits "
        f"(activations {format_bytes(per_sample)} per sample, measured; now {batch}; a larger batch changes "
        "the results: retune --lr)"
    )


def measured_of_summary(s: dict[str, Any]) -> Measured:
    """The doctor's figures from a run's summary (summary.json's keys)."""
    seconds = (s.get("time") or {}).get("seconds") or {}
    training = sum(seconds.get(p) or 0.0 for p in ("data", "compute", "grad_sync", "optimizer"))
    outside = {p: v for p, v in seconds.items() if p not in ("data", "compute", "grad_sync", "optimizer") and v}
    wall = (s.get("time") or {}).get("wall_s")
    if sum(seconds.get(p) or 0.0 for p in ("data", "compute", "grad_sync", "optimizer")) < MIN_MEASURED_S:
        seconds = {}  # too few steps timed for their shares to say anything
    act, batch = s.get("activation_bytes_per_rank"), s.get("batch_size")
    fixed = bool(s.get("global_batch_fixed"))
    peaks = s.get("peak_memory_bytes") or []
    return Measured(
        **{f"{p}_s": seconds.get(p) for p in ("data", "compute", "grad_sync", "optimizer")},
        gpu_busy=(s.get("time") or {}).get("gpu_busy"),
        peak_bytes=max(peaks) if peaks else None,
        device_bytes=s.get("device_memory_bytes"),
        activation_bytes_per_sample=act / batch if act and batch and not fixed else None,
        batch_size=None if fixed else batch,
        world_size=s.get("world_size") or 1,
        accumulate=s.get("accumulate") or 1,
        compile=bool(s.get("compile")) if "compile" in s else None,  # what was compiled, or None: nothing
        fused_optimizer=s.get("fused_optimizer"),
        optimizer=s.get("optimizer"),
        num_workers=s.get("num_workers") if s.get("workers_apply") else None,
        cores_per_process=s.get("cores_per_process"),
        global_batch_fixed=fixed,
        wall_s=wall,
        training_s=training if seconds or outside else None,
        outside_s=outside,
    )
