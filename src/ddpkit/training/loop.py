"""The training loop: the same on 1 or N ranks, whoever started the processes.

fit() reads like the guide's Trainer (and nanoGPT's loop): train pass after pass and, at each
moment the cadence names (cadence.py), evaluate, report, checkpoint; the run ends where the
cadence says. A step is step.py, a pass epoch.py, checkpoints the checkpointer's
(checkpoint/checkpointer.py); everything that depends on DDP vs FSDP is behind the Strategy.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..checkpoint.checkpointer import Checkpointer, Stateful
from ..checkpoint.state import Position
from ..checkpoint.world_mark import WorldMark
from ..config import BatchPlan, RunConfig
from ..data import ShardedLoader, StreamLoader
from ..data.loaders import rank_loader
from ..data.placement import ON_DEVICE, place_on_device, tensors_of
from ..data.streams import is_stream
from ..planning.process import (
    device_budget,
    local_state_bytes,
    peak_memory_bytes,
    reset_peak_memory,
    state_bytes_at_start,
)
from ..reporting.metrics import MetricsLog
from ..reporting.progress import Progress, choose_mode
from ..reporting.sinks.base import FAILED, FINISHED, STOPPED, SinkSettings
from ..reporting.slow_nodes import slow_node_recorder
from ..runtime import Runtime
from ..strategies import Strategy, make_strategy
from ..strategies.activation import has_blocks
from ..strategies.ddp_knobs import is_fused
from ..task import Task
from .cadence import Cadence, Moment, StepPlan
from .epoch import EpochRun, RunTotals
from .evaluate import evaluate
from .flops import throughput_of
from .ledger import PARTS, STARTUP_PARTS, Ledger
from .oom import OomAdvice
from .profile import LabelledSteps, StepProfile
from .schedule import make_scheduler, replan
from .signals import StopRequest, agreed_signal
from .step import StepRunner
from .stragglers import StepClock
from .trace import ParamTrace


def fit(
    cfg: RunConfig,
    task: Task,
    rt: Runtime,
    run_dir: Path,
    batches: BatchPlan,
    stop: StopRequest | None = None,
    mark: WorldMark | None = None,
    begin: Callable[[], None] | None = None,
    fixed: int | None = None,
    oom: OomAdvice | None = None,
    ledger: Ledger | None = None,
) -> dict[str, Any]:
    """Train `task` as `cfg` says, in the global batches of `batches` (cfg.batch_plan at this world
    size, planned once by the caller); returns the run's summary (the same on every rank).
    With `stop`, a signal makes every rank save a checkpoint at the same step boundary and return.
    With `mark` (claimed), every rank stops at the same step once another world has claimed the run directory.
    `begin()`: called once everything that may refuse the run has passed (the resume included),
    before anything is written into the run directory: a refusal leaves it as it was.
    `fixed`: this process's memory before the model (the summary's breakdown of its peak).
    Running out of memory anywhere in it raises OutOfMemory, a few lines that say where and what
    to try (oom.py; `oom`: the caller's, which may hold what the plan said).
    `ledger`: where the run's wall time goes (ledger.py; the caller's holds the start-up)."""
    oom = oom or OomAdvice.of(cfg, rt.env, run_dir, rt.device.type)
    with oom.watching():
        # model, optimizer, data, steps, checkpoints: resumed
        run = Run(cfg, task, rt, run_dir, batches, stop, mark, begin, oom, fixed, ledger)
        moment, timing = None, run.ledger.timing
        try:
            with run.checkpointer.writing():  # --async-save: every checkpoint is on disk when this block is left
                for moment in run.cadence.moments(run.start_pass):
                    record = run.record(moment)  # a pass's figures (one all-reduce), or a step's place
                    if moment.evaluate:
                        with timing("eval"):
                            record.update(run.evaluate())
                    run.report(record, moment)
                    if moment.save:
                        with timing("checkpoint"):
                            run.checkpointer.save(moment.position(), record)
                    if moment.snapshot:
                        with timing("checkpoint"):
                            run.checkpointer.snapshot(moment.global_step, moment.position)
            return run.finish(moment)
        except BaseException as e:  # a tracker's run is marked so (nothing more when finish() closed the log)
            run.log.close_after_failure(STOPPED if isinstance(e, KeyboardInterrupt) else FAILED)
            raise


class Run:
    """What one fit() holds, built in the order torch needs: the strategy wraps the model and
    builds the optimizer, the data is cut per rank, the step runner and the checkpointer take
    their parts, a resume puts everything where its checkpoint was, then the plan of the steps
    left (at this world size and batch) and the cadence follow."""

    def __init__(
        self,
        cfg: RunConfig,
        task: Task,
        rt: Runtime,
        run_dir: Path,
        batches: BatchPlan,
        stop: StopRequest | None,
        mark: WorldMark | None = None,
        begin: Callable[[], None] | None = None,
        oom: OomAdvice | None = None,
        fixed: int | None = None,
        ledger: Ledger | None = None,
    ) -> None:
        reset_peak_memory(rt.device)
        self.ledger = ledger or Ledger()  # where the wall time goes: a restart carries it in the checkpoints
        self.cfg, self.task, self.rt, self.run_dir, self.stop, self.mark = cfg, task, rt, run_dir, stop, mark
        self.batches, self.oom, self.fixed = batches, oom, fixed  # fixed: this process's memory before the model
        self.strategy = make_strategy(cfg, rt, task)  # DDP or FSDP, the precision, DDP's knobs
        # FLOPs of a sample (counted on the meta device), tokens, the device's peak: before the model is set up
        self.throughput = throughput_of(task, cfg, rt, self.strategy.precision)
        self.model = self.strategy.setup_module(task.model)
        self.optimizer = self.strategy.setup_optimizer(task.optimizer, self.model, cfg.lr)
        if oom is not None:  # counted now: a rank that has run out of memory cannot count it
            oom.strategy, oom.checkpointing = self.strategy.name, bool(self.strategy.checkpointed)
            oom.blocks = oom.checkpointing or has_blocks(task.model, self.strategy.checkpoint_blocks)
            oom.state = state_bytes_at_start(self.model, self.optimizer, task.optimizer)
        # a global order over a map-style set, or a stream's readers
        self.loader = make_loader(task.train_set, cfg, rt, batches)
        self.checkpointer = Checkpointer(
            run_dir, rt, self.strategy, self.model, self.optimizer, cfg.faults, cfg.as_dict(), mark
        )
        scheduler = make_scheduler(
            task.scheduler,
            cfg.lr_schedule,
            cfg.warmup_steps,
            self.optimizer,
            StepPlan(cfg, self.loader, Position()).total_steps,
            cfg.min_lr,
            cfg.decay_fraction,
        )
        self.profile = StepProfile.from_env(rt)  # DDPKIT_PROFILE_STEPS: these steps under torch.profiler
        self.steps = self._step_runner(scheduler)
        self.planned = PlannedSteps()
        self._register_parts(scheduler)
        start = self.resume()
        if begin is not None:
            begin()  # nothing refused the run: from here on it writes into its folder
        if self.steps.after_step is not None:
            self.steps.after_step.step = start.global_step  # a resumed trace continues the run's count
        self.plan = self.planned.plan = StepPlan(cfg, self.loader, start)  # the steps left at this world size and batch
        replan(scheduler, self.plan.total_steps, self.planned.saved, rt.print)
        self._follow(start)

    def _step_runner(self, scheduler: Any) -> StepRunner:
        """What runs one optimizer step: --accumulate micro-batches (the batch plan's), the
        scheduler, the grad scaler, the timed save, --trace-steps (labelled under a profile)."""
        cfg = self.cfg
        return (StepRunner if self.profile is None else LabelledSteps)(
            self.rt,
            self.strategy,
            self.model,
            self.optimizer,
            loss_fn=self.task.loss_fn,
            accumulate=self.batches.accumulate,
            on_nan=cfg.on_nan,
            stop=self.stop,
            step_fn=self.task.step,
            clip_grad_norm=cfg.clip_grad_norm,
            scheduler=scheduler,
            scaler=self.strategy.grad_scaler(),
            timed_save=self.checkpointer.clock_due,
            finite_checkpoint=lambda: self.checkpointer.finite_checkpoint,
            after_step=ParamTrace(self.run_dir, self.strategy, self.model) if cfg.trace_steps else None,
            mark=self.mark,
        )

    def _register_parts(self, scheduler: Any) -> None:
        """The checkpoint's parts beside the model and optimizer (those this run has)."""
        for name, part in (
            ("scheduler", scheduler and Stateful(scheduler)),
            ("scaler", self.steps.scaler and Stateful(self.steps.scaler)),
            ("stream", StreamPosition(self.loader, self.rt) if isinstance(self.loader, StreamLoader) else None),
            ("planned_steps", self.planned),
            ("ledger", self.ledger),
        ):
            if part is not None:
                self.checkpointer.register(name, part)

    def _follow(self, start: Position) -> None:
        """From `start` on: the cadence of the plan's steps, the metrics log, the progress lines,
        the run's totals and the straggler clock."""
        cfg, rt = self.cfg, self.rt
        self.cadence = Cadence(
            self.plan, start, cfg.eval_every, cfg.eval_every_steps, self.checkpointer, self.steps.stop_requested
        )
        if self.oom is not None:
            self.oom.steps_done = lambda: self.cadence.global_step
        self.log = MetricsLog(
            self.run_dir,
            enabled=rt.is_main,
            keep_until_epoch=start.epoch,
            keep_until_step=start.global_step,
            settings=SinkSettings.of(cfg, rt.world_size),
        )  # each sink decides from the output section whether it is wanted; trackers log every setting
        self.progress = Progress(
            choose_mode(cfg.progress, cfg.quiet, rt.is_main, sys.stdout),
            self.plan.passes,
            start.epoch,
            self.loader.n,
            max_steps=cfg.max_steps,
            throughput=self.throughput,
        )
        self.totals = RunTotals(resumed_from=start.epoch)
        self.clock = StepClock(
            rt,
            cfg.straggler_every,
            say=None if cfg.quiet else rt.print,
            on_check=slow_node_recorder(rt.is_main, rt.env.node_rank),  # `ddpkit slurm --exclude-slow`
        )
        self.ledger.snapshot_source = self.clock  # the step parts: the clock's sums
        self.ledger.watch(self.optimizer, rt.device)

    def resume(self) -> Position:
        """--resume/--auto-resume: the checkpoint's position; a map-style set continues at its sample."""
        cfg = self.cfg
        if not self.checkpointer.restarting(cfg.resume or cfg.auto_resume):
            return Position()
        pos = self.checkpointer.resume(cfg.resume, self.loader.n, self.loader.global_batch_size, quiet=cfg.quiet)
        if pos.mid_epoch and isinstance(self.loader, ShardedLoader):
            self.loader.load(
                {"epoch": pos.epoch, "samples": pos.samples}
            )  # that sample of the global order, at any world size
        return pos

    def start_pass(self, epoch: int, start: Position) -> EpochRun:
        self.ledger.passes_start()
        self.loader.set_epoch(epoch)
        self.model.train()
        return EpochRun(self.rt, self.progress, self.loader, self.steps, epoch, start, self.clock, self.profile)

    def record(self, moment: Moment) -> dict[str, Any]:
        if not moment.pass_end:
            return {"epoch": moment.epoch_run.epoch + 1, "step": moment.global_step}
        record = moment.epoch_run.finish(moment.global_step)
        self.totals.add_epoch(record, moment.epoch_run)
        return record

    def evaluate(self) -> dict[str, Any]:
        task, cfg = self.task, self.cfg
        if task.eval_set is None:
            return {}
        return evaluate(
            self.model,
            task.eval_set,
            task.loss_fn,
            task.metric,
            task.metric_name,
            self.rt,
            self.strategy,
            cfg.batch_size,
            cfg.num_workers,
            task.step,
        )

    def report(self, record: dict[str, Any], moment: Moment) -> None:
        """metrics.jsonl (+ csv, TensorBoard), the task's on_metrics hook on rank 0, the epoch
        line: for every pass, and for an evaluation inside one."""
        if moment.pass_end:
            rates = moment.epoch_run.rates()
            rates.update(self.throughput.rates(rates["samples_per_s"]))  # tokens/s, TFLOP/s per device, MFU
            record.update(rates, lr=self.optimizer.param_groups[0]["lr"], **self.steps.figures())
        elif moment.evaluate:
            record["lr"] = self.optimizer.param_groups[0]["lr"]
        else:
            return  # a checkpoint or a stop inside a pass: nothing to report
        self.log.write(record)
        if self.task.on_metrics is not None and self.rt.is_main:
            self.task.on_metrics(dict(record))  # global values: every number above is already reduced across ranks
        if moment.pass_end:
            self.progress.end_epoch(record)

    def finish(self, moment: Moment | None) -> dict[str, Any]:
        """The final model.pt (unless a signal stopped the run) and the run's summary."""
        self._idle_at_end()
        self.progress.close()
        if self.profile is not None:
            self.profile.close(reached=self.cadence.global_step)
        stopped = moment is not None and moment.stop and not moment.finished
        if stopped:
            self.totals.stop(0.0 if moment.pass_end else moment.epoch_run.elapsed(), self._stop_signal())
        else:
            if self.mark is not None and self.mark.lost_anywhere(self.rt.collectives, self.rt.device):
                raise self.mark.error("the end of the run, before model.pt")  # after the last step's agreement
            with self.ledger.timing("checkpoint"):
                self.strategy.save_full_model(self.model, self.run_dir / "model.pt")  # every rank: FSDP gathers
            self.checkpointer.end_snapshots()  # the run is done: nothing to restart from memory
        self.log.close(STOPPED if stopped else FINISHED)  # after model.pt: a tracker's run ends as the run did
        memory = self.checkpointer.memory
        totals = self.totals.summary(self.task.metric_name)
        return (
            totals
            | {"throughput": self.throughput.summary(totals["samples_per_s"])}
            | {
                "grad_sync": self.strategy.grad_sync(self.model),
                "steps_done": self.cadence.global_step,
                "checkpoint_step": self.checkpointer.saved_step,  # what a stop by a signal may say it saved
                "steps_planned": self.plan.total_steps,
                "data": self.loader.data,  # where the batches were gathered: "on device" or "loader"
                "fused_optimizer": is_fused(self.optimizer),
                "compile": self.strategy.compiled,  # --compile: backend, why, what (strategies/compiling.py)
                "deterministic": torch.are_deterministic_algorithms_enabled(),  # --deterministic, as it ran
            }
            | memory_stats(self.rt, self.strategy, self.model, self.optimizer, self.steps.activation_bytes, self.fixed)
            | self.clock.summary()
            | self._time_figures()
            | self._settings_ran()
            | ({"snapshot_every_steps": memory.every} if memory is not None else {})
            | ({"recovery": memory.recovery} if memory is not None and memory.recovery else {})
        )

    def _idle_at_end(self) -> None:
        """The ledger's idle at the end: how long this rank waits for the slowest to arrive (one
        small all-reduce, which every rank's queued work precedes)."""
        if not self.rt.distributed:
            return
        t0 = time.perf_counter()
        self.rt.collectives.all_reduce_(torch.zeros(1, dtype=torch.float64, device=self.rt.device)).item()
        self.ledger.seconds["idle_end"] += time.perf_counter() - t0

    def _time_figures(self) -> dict[str, Any]:
        """Every rank's ledger, the mean of the ranks (one all-reduce): seconds per part since the
        launch, the GPU-busy share where sampled. The wall time is the summary's (worker.py)."""
        self.ledger.steps(self.clock.run)
        mine = self.ledger.close()
        busy = mine["gpu_busy"]
        values = [mine["seconds"][p] for p in PARTS] + [mine["startup"][p] for p in STARTUP_PARTS]
        values += [busy or 0.0, 1.0 if busy is not None else 0.0]
        t = torch.tensor(values, dtype=torch.float64, device=self.rt.device)
        if self.rt.distributed:
            self.rt.collectives.all_reduce_(t)
        total = t.tolist()
        world = self.rt.world_size
        return {
            "time_parts": {p: total[i] / world for i, p in enumerate(PARTS)},
            "startup_parts": {p: total[len(PARTS) + i] / world for i, p in enumerate(STARTUP_PARTS)},
            "launched": self.ledger.launched,
            "gpu_busy": total[-2] / total[-1] if total[-1] else None,
        }

    def _settings_ran(self) -> dict[str, Any]:
        """What the performance doctor (reporting/advice.py) must know not to suggest what ran
        (whether it compiled: the summary's "compile", which setup_module filled)."""
        cfg, rt = self.cfg, self.rt
        return {
            "optimizer": type(self.optimizer).__name__,
            "num_workers": cfg.num_workers,
            # the loader's workers fetch map-style samples; tensors are indexed whole
            "workers_apply": self.loader.data != ON_DEVICE and tensors_of(self.task.train_set) is None,
            "cores_per_process": max(1, (os.cpu_count() or 1) // max(1, rt.env.local_world_size)),
            "device_memory_bytes": _budget(cfg, rt),
        }

    def _stop_signal(self) -> str | None:
        """The signal that stopped the run, agreed by every rank (those that received none too:
        another node's pod was evicted), by one small all-reduce at the stop."""
        if self.stop is None:
            return None

        def all_max(value: int) -> int:
            t = torch.tensor([float(value)], dtype=torch.float64, device=self.rt.device)
            return int(self.rt.collectives.all_reduce_(t, "max").item())

        return agreed_signal(self.stop.received, all_max)


class PlannedSteps:
    """A checkpoint part: the optimizer steps the run planned when it was written (a resume
    whose plan differs says so for a task's own scheduler, which cannot be re-planned)."""

    def __init__(self) -> None:
        self.plan: StepPlan | None = None
        self.saved: int | None = None

    def state(self) -> int:
        return self.plan.total_steps if self.plan is not None else 0

    def load(self, state: int) -> None:
        self.saved = int(state)


class StreamPosition:
    """A checkpoint part: every rank's position in its stream shards (a collective to save)."""

    def __init__(self, loader: StreamLoader, rt: Runtime) -> None:
        self.loader, self.rt = loader, rt

    def state(self) -> list[dict[str, Any]]:
        """One state per data-parallel rank, in its order: the ranks of a tp group (and the stages of
        a pipeline) read the same shards, so the first of each group answers for it."""
        states = self.rt.all_gather_object(self.loader.state())
        dims = self.rt.dims
        return [s for r, s in enumerate(states) if _first_of_group(dims, r)]

    def load(self, states: list[dict[str, Any]]) -> None:
        self.loader.load(states)


def _first_of_group(dims: Any, rank: int) -> bool:
    placed = dataclasses.replace(dims, rank=rank)
    return placed.tp_rank == 0 and placed.pp_rank == 0


def make_loader(dataset: Any, cfg: RunConfig, rt: Runtime, plan: BatchPlan) -> ShardedLoader | StreamLoader:
    """This rank's batches of the training set: micro-batches of --batch-size, --accumulate per step,
    or its share of `plan`'s fixed global batch (the same loader rt.loader gives an own loop), gathered
    on the device when the set is tensors that fit (--data-on-device, data/placement.py)."""
    placed = not is_stream(dataset) and place_on_device(dataset, cfg.data_on_device, rt.device, _budget(cfg, rt))
    if cfg.num_workers and tensors_of(dataset) is not None and not cfg.quiet:
        rt.print(
            f"ddpkit: note: --num-workers {cfg.num_workers} is not used: the training set is tensors, each batch "
            f"one indexing op ({'on the device' if placed else 'on the host'})"
        )
    return rank_loader(
        dataset,
        cfg.batch_size * cfg.accumulate,
        rt,
        cfg.seed,
        cfg.shuffle,
        num_workers=cfg.num_workers,
        global_batch=plan.global_batch if plan.fixed else None,
        **({"device": rt.device} if placed else {}),
    )


def _budget(cfg: RunConfig, rt: Runtime) -> int | None:
    """The rank's memory budget the placement rule takes its share of (a GPU's; None on a CPU)."""
    if rt.device.type == "cpu":
        return None
    return device_budget(cfg.device_memory, rt.device.type, rt.env.local_world_size)[0]


def memory_stats(
    rt: Runtime,
    strategy: Strategy,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    activations: int | None = None,
    fixed: int | None = None,
) -> dict[str, Any]:
    """Strategy, precision, this run's model state per rank, every rank's measured peak, the
    activations its first forward kept for backward and its fixed cost (the most of the ranks)."""
    mine = {
        "state": local_state_bytes(model, optimizer),
        "peak": peak_memory_bytes(rt.device),
        "act": activations,
        "fixed": fixed,
    }
    everyone = rt.all_gather_object(mine)
    return {
        "fixed_bytes_per_rank": max((e["fixed"] for e in everyone if e["fixed"] is not None), default=None),
        "strategy": strategy.name,
        "precision": strategy.precision,
        "state_bytes_per_rank": {k: max(e["state"][k] for e in everyone) for k in mine["state"]},
        "peak_memory_bytes": [e["peak"][0] for e in everyone],
        "peak_memory_kind": mine["peak"][1],
        "activation_bytes_per_rank": max((e["act"] for e in everyone if e["act"] is not None), default=None),
        "activation_checkpointing": bool(strategy.checkpointed),
    }
