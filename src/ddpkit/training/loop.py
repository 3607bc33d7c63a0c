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
from ..data import ShardedLoader
from ..errors import DdpkitError
from ..reporting.metrics import MetricsLog
from ..reporting.progress import Progress, choose_mode
from ..runtime import Runtime
from ..strategies import Strategy, make_strategy
from ..strategies.memory import local_state_bytes, peak_memory_bytes
from ..task import Task, accuracy_sum
from .evaluate import evaluate
from .resume import resume
from .signals import StopRequest
from .step import StepRunner


def fit(cfg: RunConfig, task: Task, rt: Runtime, run_dir: Path, stop: StopRequest | None = None) -> dict[str, Any]:
    """Train `task` as `cfg` says; returns the run's summary (the same on every rank).
    With `stop`, a signal makes every rank save a checkpoint at the same step boundary and return."""
    loss_fn = task.loss_fn or nn.CrossEntropyLoss()
    metric = task.metric or (accuracy_sum if isinstance(loss_fn, nn.CrossEntropyLoss) else None)
    strategy = make_strategy(cfg, rt, task)  # DDP or FSDP, the precision, DDP's knobs
    model, optimizer = strategy.setup(task, cfg.lr)
    pos = Position()
    if cfg.resume or cfg.auto_resume:
        pos = resume(run_dir, rt, strategy, model, optimizer, required=cfg.resume, quiet=cfg.quiet)
    loader = ShardedLoader(task.train_set, cfg.batch_size * cfg.accumulate, rt.rank, rt.world_size, cfg.seed, cfg.shuffle,
                           num_workers=cfg.num_workers)
    steps = StepRunner(rt, strategy, model, optimizer, loss_fn, cfg.accumulate, cfg.on_nan, stop)
    log = MetricsLog(run_dir, enabled=rt.is_main, keep_until_epoch=pos.epoch, csv=cfg.csv, tensorboard=cfg.tensorboard)
    progress = Progress(choose_mode(cfg.progress, cfg.quiet, rt.is_main, sys.stdout), cfg.epochs, pos.epoch, loader.n)

    def save(at: Position) -> None:
        strategy.save_checkpoint(run_dir, model, optimizer, at, cfg.as_dict())

    run = RunTotals(resumed_from=pos.epoch)
    for epoch in range(pos.epoch, cfg.epochs):
        loader.set_epoch(epoch)
        model.train()
        epoch_run = EpochRun(rt, progress, loader, epoch, pos if epoch == pos.epoch else Position(epoch))
        for step, (batch, n_local, n_global) in enumerate(loader.iter_steps(skip=epoch_run.first_step), start=epoch_run.first_step):
            result = steps.run(batch, n_local, n_global, where=f"epoch {epoch + 1}, step {step + 1}")
            epoch_run.add(result, n_local, n_global)
            if result.stop and step + 1 < len(loader):  # a signal: save here, between two steps, and stop
                save(Position(epoch, step + 1, rt.all_sum(epoch_run.loss_sum).item()))
                run.stop(epoch_run.elapsed(), stop)
                break
        if run.stopped_early:
            break
        record = epoch_run.finish(cfg.epochs)
        run.add_epoch(record, epoch_run)
        if task.eval_set is not None and ((epoch + 1) % cfg.eval_every == 0 or epoch + 1 == cfg.epochs):
            record.update(evaluate(model, task.eval_set, loss_fn, metric, task.metric_name, rt, strategy,
                                   cfg.batch_size, cfg.num_workers))
        record.update(epoch_run.rates(), lr=optimizer.param_groups[0]["lr"])
        report(record, log, progress, task, rt)
        done = epoch + 1 == cfg.epochs
        stopping = not done and steps.stop_requested()
        if stopping or (cfg.save_every and ((epoch + 1) % cfg.save_every == 0 or done)):
            save(Position(epoch + 1))
        if stopping:
            run.stop(0.0, stop)
            break
    progress.close()
    log.close()
    if not run.stopped_early:
        final = strategy.full_state_dict(model)  # gathered from the shards under FSDP: every rank takes part
        if rt.is_main:
            ckpt_file.save_or_explain(final, run_dir / "model.pt")
    return run.summary(task.metric_name) | {"grad_sync": strategy.grad_sync(model)} | memory_stats(rt, strategy, model, optimizer)


class EpochRun:
    """One epoch's running figures: this rank's loss sum (rank 0 also carries the steps done
    before a mid-epoch stop), skipped steps, time."""

    def __init__(self, rt: Runtime, progress: Progress, loader: ShardedLoader, epoch: int, start: Position) -> None:
        self.rt, self.progress, self.loader, self.epoch = rt, progress, loader, epoch
        self.first_step = start.step
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=rt.device)
        carried = start.loss_sum if start.step and rt.is_main else 0.0
        if carried:
            self.loss_sum += carried  # the global sum of the steps done before the stop
        self.skipped = 0
        self.t0 = time.perf_counter()
        progress.start_epoch(epoch, skipped_samples=min(loader.n, start.step * loader.global_batch_size), loss_offset=carried)

    def add(self, result: Any, n_local: int, n_global: int) -> None:
        if result.loss_sum is None:
            self.skipped += 1  # --on-nan skip
            return
        self.loss_sum += result.loss_sum
        self.progress.step(n_local, n_global, self.loss_sum)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def finish(self, epochs: int) -> dict[str, Any]:
        """The epoch's record so far: its global mean training loss (one all-reduce)."""
        train_loss = self.rt.all_sum(self.loss_sum).item() / self.loader.n
        self.epoch_s = self.elapsed()
        if not math.isfinite(train_loss):
            raise DdpkitError(f"the training loss is {train_loss} in epoch {self.epoch + 1}; no checkpoint of these weights "
                              "was written (lower --lr?)")
        record: dict[str, Any] = {"epoch": self.epoch + 1, "train_loss": train_loss}
        if self.skipped:
            record["skipped_steps"] = self.skipped
        return record

    def rates(self) -> dict[str, Any]:
        s = self.epoch_s
        return {"epoch_s": round(s, 6), "samples_per_s": round(self.loader.n / s, 2) if s > 0 else None}


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
        self.samples += epoch_run.loader.n

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


def report(record: dict[str, Any], log: MetricsLog, progress: Progress, task: Task, rt: Runtime) -> None:
    """metrics.jsonl (+ csv, TensorBoard), the task's on_metrics hook on rank 0, the epoch line."""
    log.write(record)
    if task.on_metrics is not None and rt.is_main:
        task.on_metrics(dict(record))  # global values: every number above is already reduced across ranks
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
