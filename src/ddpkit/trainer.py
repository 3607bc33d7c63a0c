"""The training loop: the same on 1 or N ranks, whoever started the processes.

Reads like the guide's Trainer: for each epoch, set the epoch on the sampler, step through
this rank's batches, average the loss across ranks, evaluate, checkpoint. The differences
are the guide's bugs fixed: the global loss is printed (not rank 0's shard), evaluation
counts every sample once, checkpoints hold the full state and are written atomically.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from . import checkpoint as ckpt_io
from .config import RunConfig
from .data import ShardedLoader, eval_batches
from .errors import DdpkitError
from .metrics import MetricsLog
from .parallel import DdpStrategy, grad_sync_used, make_strategy, plain_state_dict, unwrap
from .plan import local_state_bytes, peak_memory_bytes
from .progress import Progress, choose_mode
from .runtime import Runtime, all_sum
from .shm_allreduce import all_reduce_small
from .signals import StopRequest
from . import tuning
from .task import Task, accuracy_sum


def fit(cfg: RunConfig, task: Task, rt: Runtime, run_dir: Path, stop: StopRequest | None = None) -> dict[str, Any]:
    """Train `task` as `cfg` says; returns the run's summary (the same on every rank).
    With `stop`, a signal makes every rank save a checkpoint at the same step boundary and return."""
    loss_fn = task.loss_fn or nn.CrossEntropyLoss()
    metric = task.metric or (accuracy_sum if isinstance(loss_fn, nn.CrossEntropyLoss) else None)
    strategy = make_strategy(cfg, rt, task)  # DDP or FSDP (parallel.py), the precision and DDP's knobs (tuning.py)
    ddp_model, optimizer = strategy.setup(task, cfg.lr)  # wrapped model, optimizer over what it steps
    position = Position()
    if cfg.resume or cfg.auto_resume:
        position = _resume(cfg, rt, run_dir, ddp_model, optimizer, strategy)
    accumulate = cfg.accumulate  # micro-batches of batch_size per optimizer step (no_sync on all but the last)
    log = MetricsLog(run_dir, enabled=rt.is_main, keep_until_epoch=position.epoch, csv=cfg.csv, tensorboard=cfg.tensorboard)
    loader = ShardedLoader(task.train_set, cfg.batch_size * accumulate, rt.rank, rt.world_size, cfg.seed, cfg.shuffle, num_workers=cfg.num_workers)
    n_train = loader.n
    progress = Progress(choose_mode(cfg.progress, cfg.quiet, rt.is_main, sys.stdout), cfg.epochs, position.epoch, n_train)
    world = rt.world_size
    last: dict[str, Any] = {}
    train_time = 0.0
    samples = 0
    stopped_early = False
    for epoch in range(position.epoch, cfg.epochs):
        loader.set_epoch(epoch)
        ddp_model.train()
        first_step = position.step if epoch == position.epoch else 0
        loss_sum = torch.zeros((), dtype=torch.float64, device=rt.device)
        skipped = 0
        if first_step and rt.is_main:
            loss_sum += position.loss_sum  # the global sum of the steps done before the stop
        t0 = time.perf_counter()
        progress.start_epoch(epoch, skipped_samples=min(n_train, first_step * loader.global_batch_size),
                             loss_offset=position.loss_sum if first_step and rt.is_main else 0.0)
        for step, (batch, n_local, n_global) in enumerate(loader.iter_steps(skip=first_step), start=first_step):
            pending = None  # non-finite losses of earlier micro-batches (no extra collective)
            step_losses = []
            for micro, n_micro, last_micro in tuning.iter_micro(batch, n_local, accumulate):
                if not last_micro and not n_micro:
                    continue  # an empty micro-batch outside the sync adds nothing
                *inputs, target = _to_device(micro, rt.device)
                with tuning.no_sync(ddp_model, skip_sync=not last_micro):
                    with strategy.autocast():
                        out = ddp_model(*inputs)
                        loss = loss_fn(out, target) if n_micro else None
                    if last_micro:
                        # One small all-reduce per optimizer step tells every rank whether any loss
                        # is NaN/inf and whether any rank got a stop signal, so all ranks act alike.
                        bad_ranks, stop_now = step_flags(loss, stop, rt.device, pending)
                        if bad_ranks:
                            break
                    elif loss is not None:
                        nonfinite = (~torch.isfinite(loss.detach())).float()
                        pending = nonfinite if pending is None else pending + nonfinite
                    if loss is not None:
                        # Weight by this micro-batch's share so DDP's average is the mean over the global batch.
                        scale = n_micro * world / n_global
                        (loss if scale == 1.0 else loss * scale).backward()
                        step_losses.append(loss.detach().double() * n_micro)
                    else:  # no sample for this rank in a short last batch: join the gradient sync with zeros
                        (_first_tensor(out).sum() * 0.0).backward()
            if bad_ranks:
                optimizer.zero_grad(set_to_none=True)  # drop what earlier micro-batches accumulated
                if cfg.on_nan == "stop":
                    raise DdpkitError(
                        f"the training loss is not finite in epoch {epoch + 1}, step {step + 1} (on {bad_ranks} of {world} "
                        "rank(s)); stopped before the optimizer step, so the last checkpoint holds finite weights "
                        "(lower --lr, check the data, or --on-nan skip)")
                skipped += 1  # --on-nan skip: every rank drops this step
                continue
            for part in step_losses:
                loss_sum += part
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            progress.step(n_local, n_global, loss_sum)
            if stop_now and step + 1 < len(loader):
                partial = all_sum(loss_sum).item()
                train_time += time.perf_counter() - t0
                save_checkpoint(rt, run_dir, ddp_model, optimizer, Position(epoch, step + 1, partial), cfg, strategy)
                stopped_early = True
                break
        if stopped_early:
            break
        train_loss = all_sum(loss_sum).item() / n_train
        epoch_s = time.perf_counter() - t0
        train_time += epoch_s
        samples += n_train
        if not math.isfinite(train_loss):
            raise DdpkitError(f"the training loss is {train_loss} in epoch {epoch + 1}; no checkpoint of these weights was written (lower --lr?)")
        record: dict[str, Any] = {"epoch": epoch + 1, "train_loss": train_loss}
        if skipped:
            record["skipped_steps"] = skipped
        if task.eval_set is not None and ((epoch + 1) % cfg.eval_every == 0 or epoch + 1 == cfg.epochs):
            record.update(evaluate(ddp_model, task.eval_set, loss_fn, metric, task.metric_name, rt, cfg, strategy))
        record.update(epoch_s=round(epoch_s, 6), samples_per_s=round(n_train / epoch_s, 2) if epoch_s > 0 else None,
                      lr=optimizer.param_groups[0]["lr"])
        log.write(record)
        if task.on_metrics is not None and rt.is_main:
            task.on_metrics(dict(record))  # global values: every number above is already reduced across ranks
        last = record
        progress.end_epoch(record)
        done = epoch + 1 == cfg.epochs
        stopping = not done and stop is not None and step_flags(None, stop, rt.device)[1]
        if stopping or (cfg.save_every and ((epoch + 1) % cfg.save_every == 0 or done)):
            save_checkpoint(rt, run_dir, ddp_model, optimizer, Position(epoch + 1), cfg, strategy)
        if stopping:
            stopped_early = True
            break
    progress.close()
    log.close()
    if not stopped_early:
        final = strategy.full_state_dict(ddp_model)  # gathered from the shards under FSDP: every rank takes part
        if rt.is_main:
            write_or_explain(final, run_dir / "model.pt")
    return {
        "epochs_done": last.get("epoch", position.epoch),
        "train_loss": last.get("train_loss"),
        "eval_loss": last.get("eval_loss"),
        f"eval_{task.metric_name}": last.get(f"eval_{task.metric_name}"),
        "train_s": train_time,
        "samples_per_s": samples / train_time if train_time > 0 and samples else None,
        "resumed_from_epoch": position.epoch,
        "stopped_early": stopped_early,
        "grad_sync": grad_sync_used(ddp_model) if strategy.name == "ddp" else strategy.name,
        "stop_signal": stop.received if stop is not None and stopped_early else None,
        **_memory_stats(rt, strategy, ddp_model, optimizer),
    }


@dataclass(frozen=True)
class Position:
    """Where training stands: `epoch` epochs done, plus `step` steps of the next one
    (a stop between steps), with the global loss sum of those steps."""

    epoch: int = 0
    step: int = 0
    loss_sum: float = 0.0


def step_flags(loss: torch.Tensor | None, stop: StopRequest | None, device: torch.device,
               pending: torch.Tensor | None = None) -> tuple[int, bool]:
    """(ranks whose loss is not finite, whether any rank asked to stop): the same on every rank.
    `pending`: non-finite losses of earlier micro-batches of this step on this rank."""
    flags = torch.zeros(2, device=device)
    if loss is not None:
        flags[0] = (~torch.isfinite(loss.detach())).float()
    if pending is not None:
        flags[0] = torch.clamp(flags[0] + pending, max=1.0)
    if stop is not None and stop.received:
        flags[1] = 1.0
    if dist.is_initialized() and dist.get_world_size() > 1 and not all_reduce_small(flags):
        dist.all_reduce(flags)
    bad, stopping = flags.tolist()
    return int(bad), stopping > 0


def evaluate(model: nn.Module, dataset: Any, loss_fn: Callable, metric: Callable | None, metric_name: str,
             rt: Runtime, cfg: RunConfig, strategy: DdpStrategy | None = None) -> dict[str, float]:
    """Loss (and metric) over the whole eval set, each sample counted exactly once."""
    module = unwrap(model)  # no DDP forward: ranks may run different numbers of eval batches
    autocast = strategy.autocast if strategy else contextlib.nullcontext
    lockstep = bool(strategy and strategy.lockstep_forward)  # FSDP: equal forward calls, empty ones padded in
    was_training = module.training
    module.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=rt.device)  # loss, metric, count
    with torch.no_grad():
        for batch in eval_batches(dataset, cfg.batch_size, rt.rank, rt.world_size, cfg.num_workers, lockstep=lockstep):
            *inputs, target = _to_device(batch, rt.device)
            with autocast():
                out = module(*inputs)
            n = len(target)
            if n == 0:
                continue
            sums[0] += loss_fn(out, target).double() * n
            if metric is not None:
                sums[1] += torch.as_tensor(metric(out, target), dtype=torch.float64, device=rt.device)
            sums[2] += n
    module.train(was_training)
    total = all_sum(sums)
    count = total[2].item()
    result = {"eval_loss": total[0].item() / count}
    if metric is not None:
        result[f"eval_{metric_name}"] = total[1].item() / count
    return result


def save_checkpoint(rt: Runtime, run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, pos: Position, cfg: RunConfig,
                    strategy: DdpStrategy | None = None) -> None:
    """Rank 0 writes the full state (FSDP: every rank its shard); every rank contributes its RNG state."""
    states = [ckpt_io.rng_state()]
    if dist.is_initialized() and rt.world_size > 1:
        gathered: list[Any] = [None] * rt.world_size
        dist.all_gather_object(gathered, states[0])
        states = gathered
    if strategy is not None and strategy.sharded:  # FSDP: a directory of shards (checkpoint_dcp.py)
        strategy.save_checkpoint(run_dir, model, optimizer, pos, states, cfg.as_dict())
        return
    if rt.is_main:
        if not all(torch.isfinite(p).all() for p in unwrap(model).parameters()):
            raise DdpkitError(f"the weights hold NaN/inf at epoch {pos.epoch + 1}; no checkpoint written, the last one is intact")
        state = ckpt_io.make_checkpoint(plain_state_dict(model), optimizer.state_dict(), pos.epoch, states, cfg.as_dict(),
                                        rt.world_size, step=pos.step, loss_sum=pos.loss_sum)
        write_or_explain(state, ckpt_io.checkpoint_path(run_dir, pos.epoch, pos.step))


def write_or_explain(obj: Any, path: Path) -> None:
    """Atomic save; a full disk or unwritable folder becomes a clear error (nothing partial
    is left, and the previous checkpoint stays the one --resume uses)."""
    try:
        ckpt_io.atomic_save(obj, path)
    except OSError as e:
        raise DdpkitError(f"cannot write {path}: {e.strerror or e}; nothing partial was left and the previous "
                          "checkpoint is intact: free space (or fix the folder) and continue with --resume") from None


def _resume(cfg: RunConfig, rt: Runtime, run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
            strategy: DdpStrategy) -> Position:
    """Rank 0 finds the newest valid checkpoint and tells all ranks: a one-file checkpoint is
    sent whole (no shared disk needed), a sharded one (FSDP) is read by every rank from the run
    dir. With --auto-resume, no checkpoint at all means a fresh start."""
    from .checkpoint_dcp import find_any_resumable, list_sharded

    message: list[Any] = [None]
    if rt.is_main:
        try:
            if not cfg.resume and not ckpt_io.list_checkpoints(run_dir) and not list_sharded(run_dir):
                message = [("fresh", None, None)]
            else:
                kind, ckpt, path, skipped = find_any_resumable(run_dir, model, optimizer)
                for reason in skipped:
                    print(f"ddpkit: skipping checkpoint: {reason}", flush=True)
                message = [(kind, ckpt, str(path))]
        except DdpkitError as e:
            message = [("error", str(e), None)]
    if dist.is_initialized() and rt.world_size > 1:
        dist.broadcast_object_list(message, src=0)
    status, payload, path = message[0]
    if status == "error":
        raise DdpkitError(payload)
    if status == "fresh":
        return Position()
    ckpt = payload
    if status == "file":
        strategy.load_full(model, optimizer, ckpt)
    else:
        strategy.load_sharded(model, optimizer, Path(path))
    rngs = ckpt["rng"]
    ckpt_io.set_rng_state(rngs[rt.rank] if len(rngs) == rt.world_size else rngs[0])
    pos = Position(int(ckpt["epoch"]), int(ckpt.get("step", 0)), float(ckpt.get("loss_sum", 0.0)))
    if not cfg.quiet:
        where = f"epoch {pos.epoch} done" + (f", {pos.step} steps into epoch {pos.epoch + 1}" if pos.step else "")
        rt.print(f"ddpkit: resuming from {path} ({where})")
    return pos


def _memory_stats(rt: Runtime, strategy: DdpStrategy, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Strategy, precision, this run's model state per rank and every rank's measured peak."""
    mine = {"state": local_state_bytes(model, optimizer), "peak": peak_memory_bytes(rt.device)}
    everyone = [mine]
    if dist.is_initialized() and rt.world_size > 1:
        everyone = [None] * rt.world_size
        dist.all_gather_object(everyone, mine)
    return {
        "strategy": strategy.name,
        "precision": strategy.precision,
        "state_bytes_per_rank": {k: max(e["state"][k] for e in everyone) for k in mine["state"]},
        "peak_memory_bytes": [e["peak"][0] for e in everyone],
        "peak_memory_kind": mine["peak"][1],
    }


def _to_device(batch: Any, device: torch.device) -> list[Any]:
    if not isinstance(batch, (list, tuple)) or len(batch) < 2:
        raise DdpkitError("each item of the training set must be (inputs..., target); got a single value")
    if device.type == "cpu":
        return list(batch)
    return [b.to(device, non_blocking=True) if isinstance(b, torch.Tensor) else b for b in batch]


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        out = list(out.values())
    return next(o for o in out if isinstance(o, torch.Tensor))
