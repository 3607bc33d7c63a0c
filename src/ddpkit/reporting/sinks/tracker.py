"""What every experiment tracker (--tracker mlflow, wandb) shares: a remote service must never
stop or slow training, so each tracker's calls run in its own background thread behind a
bounded queue, each tried a few times; one that keeps failing becomes one warning line and
the run goes on without it (metrics.jsonl has every record). Records that wait in the queue
(a tracker slower than training, or still starting its run) are sent together, a batch per
call, so the end of a run does not wait for one request per record. The tracker's run id is
kept in RUN_DIR/tracker-NAME.json, so a resumed run continues the same tracker run; a run that
fails or is stopped marks its tracker run so (`finish(ending)`), and the launcher marks one
that its rank 0 could not (`end_abandoned`: killed by a signal, out of memory)."""

from __future__ import annotations

import abc
import json
import math
import queue
import sys
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping

from .base import FAILED, FINISHED, MetricSink, ResumePoint, SinkSettings

_STOP = object()


class Tracker(MetricSink):
    """A MetricSink whose work happens in a background thread. A subclass says how to start or
    continue its run (`start`), log one record's numbers at a step (`log`) and end (`finish`)."""

    package: ClassVar[str]  # the module it imports, and the ddpkit extra that installs it
    tries = 3  # each call, before the tracker is given up
    retry_wait_s = 1.0  # times the try number, between tries
    queue_size = 10_000  # records waiting for a slow tracker; beyond that they are dropped (with a warning)
    close_wait_s = 60.0  # close() waits this long for the queue to drain, then leaves the thread behind
    failed_wait_s = 10.0  # the same after a failure: torch's agent kills the worker 30 s after it stops it
    batch_records = 1000  # records sent together at most (MLflow takes 1000 metrics per call)

    def open(self, run_dir: Path, settings: SinkSettings, resume: ResumePoint) -> None:
        self.run_dir = Path(run_dir)
        self.given_up = False
        self.dropped = 0
        self.queue: queue.Queue[Any] = queue.Queue(self.queue_size)
        old = self.read_id() if settings.resuming else None
        self.queue.put((self.start, (settings, old), "start its run"))
        self.thread = threading.Thread(target=self._drain, name=f"ddpkit-tracker-{self.name}", daemon=True)
        self.thread.start()

    def write(self, record: Mapping[str, Any], global_step: int | None) -> None:
        if self.given_up:
            return
        step = global_step if global_step is not None else int(record.get("epoch", 0))
        try:
            self.queue.put_nowait((self.log, (numbers(record), step), "log metrics"))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                warn(f"--tracker {self.name} falls behind; records are dropped until it catches up")

    def close(self, ending: str = FINISHED) -> None:
        wait = self.failed_wait_s if ending == FAILED else self.close_wait_s
        self.ending = ending
        try:
            self.queue.put(_STOP, timeout=wait)
        except queue.Full:
            pass
        self.thread.join(wait)
        if self.thread.is_alive():
            warn(f"--tracker {self.name} had not finished after {wait:g} s; leaving it")

    @abc.abstractmethod
    def start(self, settings: SinkSettings, old_id: dict[str, Any] | None) -> dict[str, Any]:
        """Start a run (or continue the one `old_id` names); returns what names it, which
        RUN_DIR/tracker-NAME.json keeps for a resume."""

    @abc.abstractmethod
    def log(self, metrics: dict[str, float], step: int) -> None:
        """The numbers of one metrics.jsonl record at the run's global step."""

    def log_many(self, records: list[tuple[dict[str, float], int]]) -> None:
        """Several records (metrics, step) at once, in order: one call where the service takes
        a batch (MLflow's log_batch), else one `log` each. What was sent is removed from
        `records`, so that a retry sends only the rest."""
        while records:
            self.log(*records[0])
            del records[0]

    def finish(self, ending: str = FINISHED) -> None:  # noqa: B027  (a tracker with nothing to end inherits this)
        """End the tracker's run, marked as `ending` says (FINISHED, STOPPED, FAILED)."""

    @classmethod
    def end_abandoned(cls, run_dir: Path, ending: str, running_only: bool = False) -> bool:
        """Mark the tracker run of `run_dir` as `ending` if it is still running (or STOPPED where
        rank 0, stopped by torch's agent, said FAILED, unless `running_only`), from outside the run
        (the launcher, once every worker is gone; a later look at a run killed without a word);
        True when it did. A tracker that
        cannot (its service does it itself, as W&B marks a run whose process is gone) keeps
        this default."""
        return False

    def id_path(self) -> Path:
        return self.run_dir / f"tracker-{self.name}.json"

    def keep_id(self, names: dict[str, Any]) -> None:
        """Keep what names the tracker's run in RUN_DIR/tracker-NAME.json as soon as the run
        exists (a start may call it before it returns): a run killed meanwhile can still be
        found, resumed and marked."""
        self.id_path().write_text(json.dumps(names) + "\n")

    def read_id(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.id_path().read_text())
        except (OSError, ValueError):
            return None

    def _drain(self) -> None:
        started, pending = False, None
        while True:
            item, pending = pending or self.queue.get(), None
            if item is _STOP:
                break
            fn, args, what = item
            if fn == self.log:  # the records waiting behind it go with it
                records = [args]
                while len(records) < self.batch_records:
                    try:
                        pending = self.queue.get_nowait()
                    except queue.Empty:
                        break
                    if pending is _STOP or pending[0] != self.log:
                        break
                    records.append(pending[1])
                    pending = None
                fn, args = self.log_many, (records,)
            if self.given_up:
                continue
            ok, result = self._try(fn, args, what)
            if ok and fn == self.start:
                started = True
                self.keep_id(result)
        if started and not self.given_up:
            self._try(self.finish, (getattr(self, "ending", FINISHED),), "end its run")

    def _try(self, fn: Callable[..., Any], args: tuple, what: str) -> tuple[bool, Any]:
        """(True, fn(*args)), tried `tries` times; after the last failure the tracker is given up."""
        error: Exception | None = None
        for attempt in range(1, self.tries + 1):
            try:
                return True, fn(*args)
            except Exception as e:  # a tracker's failure of any kind must not reach training
                error = e
                if attempt < self.tries:
                    time.sleep(self.retry_wait_s * attempt)
        self.given_up = True
        first = (str(error).strip().splitlines() or [""])[0]
        first = first if len(first) <= 200 else first[:200] + "..."
        warn(
            f"--tracker {self.name} could not {what} after {self.tries} tries "
            f"({type(error).__name__}: {first}); training goes on without it (metrics.jsonl has every record)"
        )
        return False, None


def numbers(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's finite numbers (the step is the axis, not a metric; flags and text are left out)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def flat_params(settings: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The run's settings as text parameters, nested ones (--task-arg) as `task_args.KEY`."""
    out: dict[str, str] = {}
    for key, value in settings.items():
        if isinstance(value, Mapping):
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    return out


def run_tags(settings: SinkSettings) -> dict[str, str]:
    """What every tracker run is tagged with: where and how it ran, and with which versions."""
    params = settings.params
    return {
        "world_size": "" if settings.world_size is None else str(settings.world_size),
        "strategy": str(params.get("strategy", "")),
        "precision": str(params.get("precision", "")),
        "ddpkit_version": _version("ddpkit"),
        "torch_version": _version("torch"),
    }


def task_name(settings: SinkSettings) -> str:
    """A name for the tracker's experiment/project when none is given: the task's own name
    (wine; mytask for mytask.py:make or pkg.mytask:make)."""
    task = str(settings.params.get("task") or "ddpkit")
    stem = task.split(":")[0].replace("\\", "/").rsplit("/", 1)[-1]
    return stem.removesuffix(".py").rsplit(".", 1)[-1] or "ddpkit"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


def warn(message: str) -> None:
    print(f"ddpkit: warning: {message}", file=sys.stderr, flush=True)
