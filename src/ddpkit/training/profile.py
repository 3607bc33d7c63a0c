"""torch.profiler over chosen optimizer steps, for benchmarks/step_profile.py:
DDPKIT_PROFILE_STEPS=A:B (global steps A..B-1, 1-based) and DDPKIT_PROFILE_OUT=DIR; every rank
writes DIR/rank{R}.json (a Chrome trace) and DIR/rank{R}.txt (the ops' totals, by self CPU time).

Why this shape:
  * The profiled span is whole loop iterations: the profiler steps ("ProfilerStep#N") at each
    data fetch, so a step's span holds the fetch, the optimizer step and the loop's bookkeeping
    after it (progress, metrics, cadence, the straggler clock) up to the next fetch: the
    framework's work between steps shows up, not only the step.
  * The step before A runs under the profiler too, as its warm-up (its trace is dropped): the
    first profiled step is not slowed by the profiler starting.
  * Labels name the parts a benchmark splits a step into: step.data (the fetch), step.run (the
    optimizer step), inside it step.forward, step.backward (the gradient sync runs inside it,
    from DDP's hooks) and step.optimizer (clipping, the optimizer, the scheduler, zero_grad).
    The hand-written baselines (benchmarks/baselines/) put the same labels on their loops.
  * Decided once, when the run starts: without the variables the loop iterates its batches and
    runs the plain StepRunner, with no label and no check per step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from ..errors import DdpkitError
from ..runtime import Runtime
from ..util.envvars import PROFILE_OUT_VAR, PROFILE_STEPS_VAR
from .step import StepResult, StepRunner

TABLE_ROWS = 40


def steps_from_env(environ: Any = None) -> tuple[int, int, Path] | None:
    """(A, B, DIR) from the variables, None when neither is set."""
    environ = os.environ if environ is None else environ
    steps, out = environ.get(PROFILE_STEPS_VAR, ""), environ.get(PROFILE_OUT_VAR, "")
    if not steps and not out:
        return None
    if not steps or not out:
        raise DdpkitError(
            f"{PROFILE_STEPS_VAR} and {PROFILE_OUT_VAR} go together: set both (e.g. "
            f"{PROFILE_STEPS_VAR}=11:16 {PROFILE_OUT_VAR}=prof) or neither"
        )
    first, sep, end = steps.partition(":")
    try:
        a, b = int(first), int(end)
    except ValueError:
        a, b = 0, 0
    if not sep or a < 1 or b <= a:
        raise DdpkitError(
            f"{PROFILE_STEPS_VAR}={steps!r}: give A:B, the optimizer steps A..B-1 to profile "
            "(1-based global steps, 1 <= A < B), e.g. 11:16"
        )
    return a, b, Path(out)


class StepProfile:
    """Runs global steps [first, end) under torch.profiler and writes this rank's files."""

    def __init__(self, rt: Runtime, first: int, end: int, out: Path) -> None:
        self.rt, self.first, self.end, self.out = rt, first, end, out
        self.prof: Any = None
        self.seen = 0  # the last step whose fetch came (a pass that ends asks once more for the next)
        self.written = False
        self.finished = False

    @classmethod
    def from_env(cls, rt: Runtime) -> StepProfile | None:
        found = steps_from_env()
        return None if found is None else cls(rt, *found)

    def around(self, batches: Iterator[Any], done: int) -> Iterator[Any]:
        """A pass's batches (the first one for global step done + 1), each fetch labelled and
        the profiler started, stepped and stopped at the fetches of the chosen steps."""
        step = done + 1
        while True:
            self._at(step)
            with record_function("step.data"):
                item = next(batches, None)
            if item is None:
                return
            yield item
            step += 1

    def _at(self, step: int) -> None:
        if self.finished or step <= self.seen:
            return
        self.seen = step
        if self.prof is None:
            if self.first - 1 <= step < self.end:  # a resumed run may start inside the span: no warm-up then
                warmup = 1 if step < self.first else 0
                self.prof = profile(
                    activities=self._activities(),
                    schedule=schedule(wait=0, warmup=warmup, active=self.end - step - warmup, repeat=1),
                    on_trace_ready=self._write,
                )
                self.prof.start()
            return
        self.prof.step()
        if step == self.end:
            self.close()

    def _activities(self) -> list[ProfilerActivity]:
        cuda = self.rt.device.type == "cuda"
        return [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]

    def close(self, reached: int | None = None) -> None:
        """Stop the profiler (the run may end inside the span: the steps so far are written)."""
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.stop()
        if not self.finished and not self.written and reached is not None:
            self.rt.print(
                f"ddpkit: {PROFILE_STEPS_VAR}={self.first}:{self.end}: the run ended at step {reached}, "
                "before the profiled steps: no profile written"
            )
        self.finished = True

    def _write(self, prof: Any) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        stem = self.out / f"rank{self.rt.rank}"
        prof.export_chrome_trace(str(stem) + ".json")
        averages = prof.key_averages()
        header = {
            "rank": self.rt.rank,
            "world_size": self.rt.world_size,
            "steps": [self.first, self.end],
            "device": str(self.rt.device),
            "threads": torch.get_num_threads(),
        }
        text = [json.dumps(header), averages.table(sort_by="self_cpu_time_total", row_limit=TABLE_ROWS)]
        if self.rt.device.type == "cuda":
            text.append(averages.table(sort_by="self_device_time_total", row_limit=TABLE_ROWS))
        Path(str(stem) + ".txt").write_text("\n".join(text) + "\n")
        self.written = True


class LabelledSteps(StepRunner):
    """The StepRunner with profiler labels on its parts: the one a profiled run builds."""

    def run(self, batch: Any, n_local: int, n_global: int, where: str) -> StepResult:
        with record_function("step.run"):
            return super().run(batch, n_local, n_global, where)

    def _forward(self, micro: Any, n_micro: int, kinds: set[bool]) -> Any:
        with record_function("step.forward"):
            return super()._forward(micro, n_micro, kinds)

    def _backward(self, loss: torch.Tensor) -> None:
        with record_function("step.backward"):
            super()._backward(loss)

    def _optimizer_step(self, found_inf: torch.Tensor | None = None) -> None:
        with record_function("step.optimizer"):
            super()._optimizer_step(found_inf)
