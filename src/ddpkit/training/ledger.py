"""Where the run's wall time went: one ledger that each phase of a worker adds to.

The parts (PARTS), in seconds of this rank's wall clock since the launcher started (LAUNCH_TIME_VAR):
  startup     the launch, the workers, the process group, imports, the task and model built, a
              resume read: up to the first training pass
  data        waiting for the next batch            } the straggler clock's sums (stragglers.py),
  compute     forward, backward, clipping           } which the loop already keeps: nothing is
  grad_sync   the gradient sync backward left exposed } added to a step for them
  optimizer   the optimizer's step (hooks on it: on a GPU, CUDA events read once a pass ends)
  eval        the evaluations
  checkpoint  saving checkpoints and model.pt: the blocking part (an --async-save write runs behind)
  restart     from a failure to the restarted workers' first pass (their start-up included)
  lost_work   the work a failure threw away: from the last checkpoint to the failure
  idle_end    waiting at the end for the slowest rank
The rest of the wall time is "other" (metrics, progress lines, the run's end, the summary).

Start-up in its parts (STARTUP_PARTS, a first launch only; a restart's is in "restart"):
  launcher       the command's start to torch's agent: the launcher's imports, the plan
  spawn          the agent to this worker's process start (/proc): rendezvous, fork or spawn
  imports        the process start to the worker's entry: a spawned worker's imports (a
                 forked one inherits the launcher's)
  process_group  the store and the process group
  task           the task built (its module imported, the model, the data), the process measured
  setup          the run folder, the model and optimizer set up, the loader: up to the first pass
A part whose clock is missing (no agent: a launcher of its own; no /proc) goes to the next one.

A restarted worker (torch's agent, --max-restarts) carries the parts up to the checkpoint it
resumes from (a checkpoint part: the seconds when it was written); the launcher leaves the
failure's time in the new attempt's error folder (RESTARTED_FILE).

GPU busy: where NVML can be read (torch.cuda.utilization, with nvidia-ml-py), a thread samples
the driver's "a kernel was running" share about once a second while the loop is in its training
passes (a sample that saw an evaluation or a checkpoint is dropped). No host synchronisation.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, Iterator

import torch

from ..util.envvars import (
    AGENT_START_VAR,
    ERROR_DIR_VAR,
    LAUNCH_TIME_VAR,
    RESTARTED_FILE,
    attempt_errors,
    restart_count,
)

PARTS = (
    "startup",
    "data",
    "compute",
    "grad_sync",
    "optimizer",
    "eval",
    "checkpoint",
    "restart",
    "lost_work",
    "idle_end",
)
STARTUP_PARTS = ("launcher", "spawn", "imports", "process_group", "task", "setup")
STEP_PARTS = ("data", "compute", "grad_sync", "optimizer")
PENDING_EVENTS = 256  # CUDA event pairs kept before those done are read (query: no synchronisation)
BUSY_INTERVAL_S = 1.0  # between GPU-busy samples (NVML's own sample period is 1/6 s to 1 s)


def launch_time(environ: Any = None) -> float | None:
    """When the launcher started (seconds since the epoch), if it said."""
    value = (os.environ if environ is None else environ).get(LAUNCH_TIME_VAR, "")
    try:
        return float(value) if value else None
    except ValueError:
        return None


def failure_time() -> float | None:
    """A restarted worker: when the launcher saw the attempt before it fail (RESTARTED_FILE)."""
    error_dir = os.environ.get(ERROR_DIR_VAR)
    if not error_dir or restart_count() == 0:
        return None
    try:
        return float((attempt_errors(error_dir, restart_count()) / RESTARTED_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def process_start() -> float | None:
    """When this process started, on the wall clock (Linux: /proc, in ticks of 10 ms); None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, since boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def startup_parts(launched: float, marks: dict[str, float | None], first_pass: float) -> dict[str, float]:
    """STARTUP_PARTS' seconds from the clocks at their ends (`marks`, by part; None: missing, its
    time goes to the next part); they sum to the start-up (first pass - launch)."""
    out, before = {}, launched
    for part in STARTUP_PARTS:
        end = first_pass if part == STARTUP_PARTS[-1] else marks.get(part)
        if end is None or end < before:
            out[part] = 0.0
            continue
        out[part], before = min(end, first_pass) - before, min(end, first_pass)
    return out


class Ledger:
    """This rank's seconds per part. `launched`: the launcher's start (else this ledger's)."""

    def __init__(self, launched: float | None = None, restarted: bool | None = None) -> None:
        self.created = time.time()
        self.launched = launched if launched is not None else launch_time() or self.created
        self.restarted = restart_count() > 0 if restarted is None else restarted
        self.failed_at = failure_time() if self.restarted else None
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.carried: dict[str, Any] | None = None  # what the checkpoint resumed from held
        self.first_pass_at: float | None = None
        self.optimizer: OptimizerTimer | None = None
        self.busy: GpuBusy | None = None
        self.inside = 0  # in a timed phase (an evaluation, a checkpoint): the busy sampler drops its sample
        self.snapshot_source: Any = None  # the straggler clock: its run sums so far (set by the loop)
        agent = os.environ.get(AGENT_START_VAR)
        self.marks: dict[str, float | None] = {
            "launcher": float(agent) if agent else None,
            "spawn": process_start(),
            "imports": self.created,  # the worker's entry makes its ledger first
        }
        self.startup = dict.fromkeys(STARTUP_PARTS, 0.0)

    def mark(self, part: str) -> None:
        """A start-up part (STARTUP_PARTS) ends now."""
        self.marks[part] = time.time()

    # -- the phases ------------------------------------------------------------------
    @contextlib.contextmanager
    def timing(self, part: str) -> Iterator[None]:
        """Wall seconds of a phase that ends in a host synchronisation anyway (an evaluation's
        all-reduce, a checkpoint's copy), so the host's clock is the device's too."""
        self.inside += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] += time.perf_counter() - t0
            self.inside -= 1

    def timed_phases(self) -> float:
        return self.seconds["eval"] + self.seconds["checkpoint"]

    def passes_start(self) -> None:
        """The first training pass starts: start-up ends (or a restart's recovery)."""
        if self.first_pass_at is not None:
            return
        self.first_pass_at = now = time.time()
        if not self.restarted:
            self.seconds["startup"] = now - self.launched
            self.startup = startup_parts(self.launched, self.marks, now)
            return
        carried = self.carried or {}
        self.seconds.update({p: float(s) for p, s in carried.get("seconds", {}).items() if p in self.seconds})
        saved_at = float(carried.get("at", self.launched))  # no checkpoint of this launch: all was lost
        failed = self.failed_at if self.failed_at is not None and self.failed_at >= saved_at else None
        self.seconds["lost_work"] += (failed - saved_at) if failed is not None else 0.0
        self.seconds["restart"] += now - (failed if failed is not None else saved_at)

    def watch(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        """The optimizer's steps are timed from now (hooks on it), and the GPU sampled."""
        self.optimizer = OptimizerTimer(optimizer, device)
        if device.type == "cuda":
            self.busy = GpuBusy.start(device, self)

    def steps(self, clock_run: list[float]) -> None:
        """The step parts from the straggler clock's run sums [data, step - wait, wait, steps]."""
        opt = self.optimizer.total() if self.optimizer is not None else 0.0
        self.seconds["data"] = self.seconds["data"] + clock_run[0]
        self.seconds["optimizer"] += opt
        self.seconds["compute"] += max(0.0, clock_run[1] - opt)
        self.seconds["grad_sync"] += clock_run[2]

    def close(self) -> dict[str, Any]:
        """This rank's figures for the summary (the optimizer's events read: once, at the end)."""
        if self.busy is not None:
            self.busy.stop()
        busy = self.busy.share() if self.busy is not None else None
        return {"seconds": dict(self.seconds), "gpu_busy": busy, "startup": dict(self.startup)}

    # -- a checkpoint part ---------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The parts so far (the step parts of the passes before this save are not counted yet:
        the clock's sums are; see snapshot_seconds) and when: what a restart of this launch carries."""
        return {"launched": self.launched, "at": time.time(), "seconds": self.snapshot_seconds()}

    def load(self, state: Any) -> None:
        if self.restarted and isinstance(state, dict) and float(state.get("at", 0.0)) >= self.launched:
            self.carried = state  # written in this launch, before the failure

    def snapshot_seconds(self) -> dict[str, float]:
        seconds = dict(self.seconds)
        run = getattr(self.snapshot_source, "run", None)
        if run is not None:
            opt = self.optimizer.total() if self.optimizer is not None else 0.0
            seconds["data"] += run[0]
            seconds["optimizer"] += opt
            seconds["compute"] += max(0.0, run[1] - opt)
            seconds["grad_sync"] += run[2]
        return seconds


class OptimizerTimer:
    """The optimizer's step time, by hooks on it: the host's clock on a CPU; on a GPU a pair of
    CUDA events per step, read when done (event.query() does not wait) and at the end."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self.t0 = 0.0
        self.pending: list[tuple[Any, Any]] = []
        self.start_event: Any = None
        self.depth = 0  # a subclass's step calling its base's runs the hooks twice, nested: the outer counts
        self.handles = []
        if hasattr(optimizer, "register_step_pre_hook"):
            self.handles = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]

    def _pre(self, *_: Any) -> None:
        self.depth += 1
        if self.depth > 1:
            return
        if self.cuda:
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.start_event.record()
        else:
            self.t0 = time.perf_counter()

    def _post(self, *_: Any) -> None:
        self.depth -= 1
        if self.depth > 0:
            return
        if not self.cuda:
            self.seconds += time.perf_counter() - self.t0
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.pending.append((self.start_event, end))
        if len(self.pending) > PENDING_EVENTS:
            self._read(wait=False)

    def _read(self, wait: bool) -> None:
        while self.pending and (wait or self.pending[0][1].query()):
            start, end = self.pending.pop(0)
            if wait:
                end.synchronize()
            self.seconds += start.elapsed_time(end) / 1e3

    def total(self) -> float:
        """The seconds so far; on a GPU this waits for the last step's events (a pass's end)."""
        self._read(wait=True)
        return self.seconds

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class GpuBusy:
    """The driver's share of time a kernel ran on this rank's GPU, sampled by a thread while the
    loop trains; None where NVML cannot be read."""

    def __init__(self, device: torch.device, ledger: Ledger) -> None:
        self.device, self.ledger = device, ledger
        self.samples: list[float] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ddpkit-gpu-busy", daemon=True)

    @classmethod
    def start(cls, device: torch.device, ledger: Ledger) -> GpuBusy | None:
        try:
            torch.cuda.utilization(device)
        except Exception:  # noqa: BLE001 - no NVML (nvidia-ml-py not installed, no driver access): no figure
            return None
        busy = cls(device, ledger)
        busy.thread.start()
        return busy

    def _run(self) -> None:
        ledger = self.ledger
        seen = ledger.timed_phases()
        while not self.done.wait(BUSY_INTERVAL_S):
            phases = ledger.timed_phases()  # a sample whose second saw more than a glimpse of them is dropped
            if not ledger.inside and phases - seen < 0.1 * BUSY_INTERVAL_S and ledger.first_pass_at is not None:
                with contextlib.suppress(Exception):
                    self.samples.append(torch.cuda.utilization(self.device) / 100.0)
            seen = phases

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=2 * BUSY_INTERVAL_S)

    def share(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None
