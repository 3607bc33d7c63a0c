"""The training loop: the same on 1 or N ranks, whoever started the processes.

fit() reads like the guide's Trainer (and nanoGPT's loop): for each epoch, step through
this rank's batches, average the loss across ranks, evaluate, checkpoint. What a step does
(micro-batches, NaN/stop agreement) is in step.py; evaluation in evaluate.py; where to
continue from in resume.py; everything that depends on DDP vs FSDP is behind the Strategy.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import file as ckpt_file
from ..checkpoint.state import Position
from ..config import RunConfig
from ..data import ShardedLoader, StreamLoader, is_stream
from ..errors import DdpkitError
from ..reporting.metrics import MetricsLog
from ..reporting.progress import Progress, choose_mode
from ..runtime import Runtime
from ..strategies import Strategy, make_strategy
from ..strategies.memory import local_state_bytes, peak_memory_bytes, reset_peak_memory
from ..task import Task
from .evaluate import evaluate
from .resume import resume
from .schedule import make_scheduler
from .signals import StopRequest
from .step import StepRunner


def fit(cfg: RunConfig, task: Task, rt: Runtime, run_dir: Path, stop: StopRequest | None = None) -> dict[str, Any]:
    """Train `task` as `cfg` says; returns the run's summary (the same on every rank).
    With `stop`, a signal makes every rank save a checkpoint at the same step boundary and return."""
    reset_peak_memory(rt.device)
    strategy = make_strategy(cfg, rt, task)  # DDP or FSDP, the precision, DDP's knobs
    model, optimizer = strategy.setup(task, cfg.lr)
    loader = make_loader(task.train_set, cfg, rt)  # a global order over a map-style set, or a stream's readers
    plan = StepPlan(cfg, None if is_stream(task.train_set) else len(loader))
    steps = StepRunner(rt, strategy, model, optimizer, task.loss_fn, cfg.accumulate, cfg.on_nan, stop, task.step,
                       cfg.clip_grad_norm, make_scheduler(task.scheduler, cfg.lr_schedule, cfg.warmup_steps, optimizer,
                                                          plan.total_steps, cfg.min_lr, cfg.decay_fraction), strategy.grad_scaler(),
                       save_every_s=cfg.save_every_minutes * 60 if cfg.save_every_minutes else None)
    pos = Position()
    if cfg.resume or cfg.auto_resume:
        pos, extra = resume(run_dir, rt, strategy, model, optimizer, required=cfg.resume, quiet=cfg.quiet)
        steps.load_state(extra)
        if extra.get("stream"):
            loader.load(extra["stream"])
        strategy.prune(run_dir)  # a crash between a save and its pruning left one too many
    at = pos.global_step or plan.global_step(pos.epoch, pos.step)  # optimizer steps done in the run
    log = MetricsLog(run_dir, enabled=rt.is_main, keep_until_epoch=pos.epoch, csv=cfg.csv, tensorboard=cfg.tensorboard,
                     keep_until_step=at)
    progress = Progress(choose_mode(cfg.progress, cfg.quiet, rt.is_main, sys.stdout), plan.passes, pos.epoch, loader.n,
                        max_steps=cfg.max_steps)

    def save(where: Position, record: dict[str, Any] | None = None) -> None:
        extra = steps.state()
        if isinstance(loader, StreamLoader):  # every rank's position in its shards
            extra["stream"] = rt.all_gather_object(loader.state())
        metric = (record or {}).get(cfg.best_metric.split(":")[0])
        strategy.save_checkpoint(run_dir, model, optimizer, where, cfg.as_dict(), extra, metric)
        steps.saved()

    def evaluation() -> dict[str, Any]:
        return evaluate(model, task.eval_set, task.loss_fn, task.metric, task.metric_name, rt, strategy, cfg.batch_size,
                        cfg.num_workers, task.step) if task.eval_set is not None else {}

    run = RunTotals(resumed_from=pos.epoch)
    with strategy.saving():  # --async-save: every checkpoint is on disk when this block is left
        for epoch in range(pos.epoch, plan.epochs):
            loader.set_epoch(epoch)
            model.train()
            epoch_run = EpochRun(rt, progress, loader, epoch, pos if epoch == pos.epoch else Position(epoch))
            for step, (batch, n_local, n_global) in enumerate(loader.iter_steps(skip=plan.skip(epoch_run.first_step)),
                                                              start=epoch_run.first_step):
                if plan.last(at):
                    break  # resumed at --max-steps: nothing left to train
                result = steps.run(batch, n_local, n_global, where=f"epoch {epoch + 1}, step {step + 1}")
                at += 1
                epoch_run.add(result, n_local, n_global)
                inside = plan.inside(step + 1) and not plan.last(at)
                if inside and plan.eval_due(at):
                    report({"epoch": epoch + 1, "step": at, **evaluation(), "lr": optimizer.param_groups[0]["lr"]}, log, None, task, rt)
                if inside and (result.stop or result.save or plan.save_due(at)):  # a signal, --save-every-steps/-minutes
                    save(epoch_run.position(step + 1, at))
                if result.stop and inside:
                    run.stop(epoch_run.elapsed(), stop)
                    break
                if plan.last(at):
                    break  # --max-steps reached
            else:
                epoch_run.complete = True  # the pass ran to its end
            if run.stopped_early:
                break
            done = epoch + 1 == plan.epochs or plan.last(at)
            record = epoch_run.finish(at)
            run.add_epoch(record, epoch_run)
            if (epoch + 1) % cfg.eval_every == 0 or done or plan.eval_due(at):
                record.update(evaluation())
            record.update(epoch_run.rates(), lr=optimizer.param_groups[0]["lr"], **steps.figures())
            report(record, log, progress, task, rt)
            stopping = not done and steps.stop_requested()
            if stopping or plan.save_due(at) or (cfg.save_every and ((epoch + 1) % cfg.save_every == 0 or done)):
                save(epoch_run.position(None, at), record)
            if stopping:
                run.stop(0.0, stop)
                break
            if done:
                break
    progress.close()
    log.close()
    if not run.stopped_early:
        final = strategy.full_state_dict(model)  # gathered from the shards under FSDP: every rank takes part
        if rt.is_main:
            ckpt_file.save_or_explain(final, run_dir / "model.pt")
    return run.summary(task.metric_name) | {"grad_sync": strategy.grad_sync(model), "steps_done": at, "steps_planned": plan.total_steps} \
        | memory_stats(rt, strategy, model, optimizer)


def make_loader(dataset: Any, cfg: RunConfig, rt: Runtime) -> ShardedLoader | StreamLoader:
    """This rank's batches of the training set: micro-batches of --batch-size, --accumulate per step."""
    batch = cfg.batch_size * cfg.accumulate
    if is_stream(dataset):
        device = rt.device if rt.backend == "nccl" else torch.device("cpu")
        return StreamLoader(dataset, batch, rt.rank, rt.world_size, cfg.seed, cfg.shuffle, num_workers=cfg.num_workers,
                            agree=rt.collectives.all_reduce_, device=device)
    return ShardedLoader(dataset, batch, rt.rank, rt.world_size, cfg.seed, cfg.shuffle, num_workers=cfg.num_workers)


class StepPlan:
    """The run in optimizer steps: how many epochs, whether --max-steps ends it, when the
    step-based evaluations and checkpoints fall. `per_epoch`: steps of a pass over a
    map-style set (None for a stream: a pass ends when the stream does)."""

    def __init__(self, cfg: RunConfig, per_epoch: int | None) -> None:
        self.per_epoch = per_epoch if per_epoch is None else max(1, per_epoch)
        self.max_steps = cfg.max_steps
        if cfg.max_steps is None:
            self.epochs = cfg.epochs
        else:  # --max-steps overrides --epochs
            self.epochs = -(-cfg.max_steps // self.per_epoch) if self.per_epoch else 1 << 30
        self.passes = self.epochs if self.epochs < 1 << 30 else None  # for the progress display
        self.total_steps = cfg.max_steps or cfg.epochs * (self.per_epoch or 0)
        if not self.total_steps and (cfg.lr_schedule != "constant" or cfg.warmup_steps):
            raise DdpkitError("--lr-schedule/--warmup-steps over a stream without a length need --max-steps "
                              "(the schedule's length)")
        self.eval_every, self.save_every = cfg.eval_every_steps, cfg.save_every_steps

    def global_step(self, epoch: int, step: int) -> int:
        """For checkpoints written before the global step was kept: map-style passes are equal."""
        return epoch * (self.per_epoch or 0) + step

    def skip(self, first_step: int) -> int:
        return first_step if self.per_epoch else 0  # a stream resumes from its saved position instead

    def inside(self, steps_done: int) -> bool:
        """Is this step boundary inside the pass (a stream's end is known only once reached)?"""
        return self.per_epoch is None or steps_done < self.per_epoch

    def last(self, at: int) -> bool:
        return self.max_steps is not None and at >= self.max_steps

    def eval_due(self, at: int) -> bool:
        return bool(self.eval_every) and at % self.eval_every == 0

    def save_due(self, at: int) -> bool:
        return bool(self.save_every) and at % self.save_every == 0


class EpochRun:
    """One epoch's running figures: this rank's [loss sum, count] (rank 0 also carries the
    global sums of the steps done before a mid-epoch stop), samples, skipped steps, time."""

    def __init__(self, rt: Runtime, progress: Progress, loader: Any, epoch: int, start: Position) -> None:
        self.rt, self.progress, self.loader, self.epoch = rt, progress, loader, epoch
        self.first_step = self.steps_done = start.step
        self.complete = False
        self.sums = torch.zeros(2, dtype=torch.float64, device=rt.device)  # loss sum, count (samples or tokens)
        done_before = min(loader.n, start.step * loader.global_batch_size) if loader.n is not None else 0
        carried = (start.loss_sum, start.count_sum or float(done_before)) if start.step and rt.is_main else (0.0, 0.0)
        if start.step and rt.is_main:
            self.sums += torch.tensor(carried, dtype=torch.float64, device=rt.device)
        self.samples = done_before if start.step else 0  # global samples of this epoch so far
        self.samples_here = 0
        self.skipped = 0
        self.t0 = time.perf_counter()
        progress.start_epoch(epoch, skipped_samples=done_before, loss_offset=carried[0], count_offset=carried[1])

    def add(self, result: Any, n_local: int, n_global: int) -> None:
        self.steps_done += 1
        self.samples += n_global
        self.samples_here += n_global
        if result.loss_sum is None:
            self.skipped += 1  # --on-nan skip
            return
        self.sums += result.loss_sum
        self.progress.step(n_local, n_global, self.sums)

    def position(self, step: int | None, at: int) -> Position:
        """Where a checkpoint taken now resumes: after `step` steps of this epoch (a collective:
        the global sums so far), or at the epoch's end (None) when the pass is complete."""
        if step is None and self.complete:
            return Position(self.epoch + 1, global_step=at)
        loss, count = self.rt.all_sum(self.sums).tolist()
        return Position(self.epoch, self.steps_done if step is None else step, loss, count, global_step=at)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def finish(self, global_step: int) -> dict[str, Any]:
        """The epoch's record so far: its global mean training loss (one all-reduce)."""
        loss, count = self.rt.all_sum(self.sums).tolist()
        train_loss = loss / count if count else float("nan")
        self.epoch_s = self.elapsed()
        if not math.isfinite(train_loss):
            raise DdpkitError(f"the training loss is {train_loss} in epoch {self.epoch + 1}; no checkpoint of these weights "
                              "was written (lower --lr?)")
        record: dict[str, Any] = {"epoch": self.epoch + 1, "step": global_step, "train_loss": train_loss}
        if self.skipped:
            record["skipped_steps"] = self.skipped
        return record

    def rates(self) -> dict[str, Any]:
        s = self.epoch_s
        return {"epoch_s": round(s, 6), "samples_per_s": round(self.samples_here / s, 2) if s > 0 else None}


class RunTotals:
    """What the run's summary counts: epochs done, training time, samples, an early stop."""

    def __init__(self, resumed_from: int) -> None:
        self.resumed_from = resumed_from
        self.last: dict[str, Any] = {}
        self.train_s = 0.0
        self.samples = 0
        self.stopped_early = False
        self.stop_signal: str | None = None

    def add_epoch(self, record: dict[str, Any], epoch_run: EpochRun) -> None:
        self.last = record
        self.train_s += epoch_run.epoch_s
        self.samples += epoch_run.samples_here

    def stop(self, seconds: float, stop: StopRequest | None) -> None:
        self.train_s += seconds
        self.stopped_early = True
        self.stop_signal = stop.received if stop is not None else None

    def summary(self, metric_name: str) -> dict[str, Any]:
        last = self.last
        return {
            "epochs_done": last.get("epoch", self.resumed_from),
            "train_loss": last.get("train_loss"),
            "eval_loss": last.get("eval_loss"),
            f"eval_{metric_name}": last.get(f"eval_{metric_name}"),
            "train_s": self.train_s,
            "samples_per_s": self.samples / self.train_s if self.train_s > 0 and self.samples else None,
            "resumed_from_epoch": self.resumed_from,
            "stopped_early": self.stopped_early,
            "stop_signal": self.stop_signal,
        }


def report(record: dict[str, Any], log: MetricsLog, progress: Progress | None, task: Task, rt: Runtime) -> None:
    """metrics.jsonl (+ csv, TensorBoard), the task's on_metrics hook on rank 0, the epoch line
    (`progress`: None for a step-based evaluation inside an epoch)."""
    log.write(record)
    if task.on_metrics is not None and rt.is_main:
        task.on_metrics(dict(record))  # global values: every number above is already reduced across ranks
    if progress is not None:
        progress.end_epoch(record)


def memory_stats(rt: Runtime, strategy: Strategy, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Strategy, precision, this run's model state per rank and every rank's measured peak."""
    mine = {"state": local_state_bytes(model, optimizer), "peak": peak_memory_bytes(rt.device)}
    everyone = rt.all_gather_object(mine)
    return {
        "strategy": strategy.name,
        "precision": strategy.precision,
        "state_bytes_per_rank": {k: max(e["state"][k] for e in everyone) for k in mine["state"]},
        "peak_memory_bytes": [e["peak"][0] for e in everyone],
        "peak_memory_kind": mine["peak"][1],
    }
