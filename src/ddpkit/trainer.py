"""The training loop: the same on 1 or N ranks, whoever started the processes.

Reads like the guide's Trainer: for each epoch, set the epoch on the sampler, step through
this rank's batches, average the loss across ranks, evaluate, checkpoint. The differences
are the guide's bugs fixed: the global loss is printed (not rank 0's shard), evaluation
counts every sample once, checkpoints hold the full state and are written atomically.
"""
from __future__ import annotations

import math
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
from .parallel import plain_state_dict, unwrap, wrap_model
from .runtime import Runtime, all_sum
from .signals import StopRequest
from .task import Task, accuracy_sum, make_optimizer
from . import tuning


def fit(cfg: RunConfig, task: Task, rt: Runtime, run_dir: Path, stop: StopRequest | None = None) -> dict[str, Any]:
    """Train `task` as `cfg` says; returns the run's summary (the same on every rank).
    With `stop`, a signal makes every rank save a checkpoint at the same step boundary and return."""
    loss_fn = task.loss_fn or nn.CrossEntropyLoss()
    metric = task.metric or (accuracy_sum if isinstance(loss_fn, nn.CrossEntropyLoss) else None)
    model = task.model.to(rt.device)  # before the optimizer, so its state lands on the device
    optimizer = tuning.fuse_optimizer(make_optimizer(task, model, cfg.lr), cfg.fused_optimizer, rt.device)
    position = Position()
    if cfg.resume or cfg.auto_resume:
        position = _resume(cfg, rt, run_dir, model, optimizer)
    ddp_model = wrap_model(model, rt, **tuning.ddp_options(cfg, rt.backend))
    tuning.register_compression(ddp_model, cfg.grad_compression)
    ddp_model = tuning.maybe_compile(ddp_model, cfg.compile)
    accumulate = cfg.accumulate  # micro-batches of batch_size per optimizer step (no_sync on all but the last)
    log = MetricsLog(run_dir, enabled=rt.is_main, keep_until_epoch=position.epoch)
    loader = ShardedLoader(task.train_set, cfg.batch_size * accumulate, rt.rank, rt.world_size, cfg.seed, cfg.shuffle, num_workers=cfg.num_workers)
    n_train = loader.n
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
        for step, (batch, n_local, n_global) in enumerate(loader.iter_steps(skip=first_step), start=first_step):
            pending = None  # non-finite losses of earlier micro-batches (no extra collective)
            step_losses = []
            for micro, n_micro, last in tuning.iter_micro(batch, n_local, accumulate):
                if not last and not n_micro:
                    continue  # an empty micro-batch outside the sync adds nothing
                *inputs, target = _to_device(micro, rt.device)
                with tuning.no_sync(ddp_model, skip_sync=not last):
                    out = ddp_model(*inputs)
                    loss = loss_fn(out, target) if n_micro else None
                    if last:
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
            if stop_now and step + 1 < len(loader):
                partial = all_sum(loss_sum).item()
                train_time += time.perf_counter() - t0
                save_checkpoint(rt, run_dir, ddp_model, optimizer, Position(epoch, step + 1, partial), cfg)
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
            record.update(evaluate(ddp_model, task.eval_set, loss_fn, metric, task.metric_name, rt, cfg))
        record.update(epoch_s=round(epoch_s, 6), samples_per_s=round(n_train / epoch_s, 2) if epoch_s > 0 else None,
                      lr=optimizer.param_groups[0]["lr"])
        log.write(record)
        last = record
        if not cfg.quiet:
            rt.print(_epoch_line(record, cfg.epochs))
        done = epoch + 1 == cfg.epochs
        stopping = not done and stop is not None and step_flags(None, stop, rt.device)[1]
        if stopping or (cfg.save_every and ((epoch + 1) % cfg.save_every == 0 or done)):
            save_checkpoint(rt, run_dir, ddp_model, optimizer, Position(epoch + 1), cfg)
        if stopping:
            stopped_early = True
            break
    if rt.is_main and not stopped_early:
        write_or_explain(plain_state_dict(ddp_model), run_dir / "model.pt")
    return {
        "epochs_done": last.get("epoch", position.epoch),
        "train_loss": last.get("train_loss"),
        "eval_loss": last.get("eval_loss"),
        f"eval_{task.metric_name}": last.get(f"eval_{task.metric_name}"),
        "train_s": train_time,
        "samples_per_s": samples / train_time if train_time > 0 and samples else None,
        "resumed_from_epoch": position.epoch,
        "stopped_early": stopped_early,
        "stop_signal": stop.received if stop is not None and stopped_early else None,
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
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags)
    bad, stopping = flags.tolist()
    return int(bad), stopping > 0


def evaluate(model: nn.Module, dataset: Any, loss_fn: Callable, metric: Callable | None, metric_name: str,
             rt: Runtime, cfg: RunConfig) -> dict[str, float]:
    """Loss (and metric) over the whole eval set, each sample counted exactly once."""
    module = unwrap(model)  # no DDP forward: ranks may run different numbers of eval batches
    was_training = module.training
    module.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=rt.device)  # loss, metric, count
    with torch.no_grad():
        for batch in eval_batches(dataset, cfg.batch_size, rt.rank, rt.world_size, cfg.num_workers):
            *inputs, target = _to_device(batch, rt.device)
            out = module(*inputs)
            n = len(target)
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


def save_checkpoint(rt: Runtime, run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, pos: Position, cfg: RunConfig) -> None:
    """Rank 0 writes the full state; every rank contributes its RNG state."""
    states = [ckpt_io.rng_state()]
    if dist.is_initialized() and rt.world_size > 1:
        gathered: list[Any] = [None] * rt.world_size
        dist.all_gather_object(gathered, states[0])
        states = gathered
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


def _resume(cfg: RunConfig, rt: Runtime, run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> Position:
    """Rank 0 finds the newest valid checkpoint and sends it to all ranks (no shared disk
    needed). With --auto-resume, no checkpoint at all means a fresh start."""
    message: list[Any] = [None]
    if rt.is_main:
        try:
            if not cfg.resume and not ckpt_io.list_checkpoints(run_dir):
                message = [("fresh", None, None)]
            else:
                ckpt, path, skipped = ckpt_io.find_resumable(run_dir, model, optimizer)
                for reason in skipped:
                    print(f"ddpkit: skipping checkpoint: {reason}", flush=True)
                message = [("ok", ckpt, str(path))]
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
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    rngs = ckpt["rng"]
    ckpt_io.set_rng_state(rngs[rt.rank] if len(rngs) == rt.world_size else rngs[0])
    pos = Position(int(ckpt["epoch"]), int(ckpt.get("step", 0)), float(ckpt.get("loss_sum", 0.0)))
    if not cfg.quiet:
        where = f"epoch {pos.epoch} done" + (f", {pos.step} steps into epoch {pos.epoch + 1}" if pos.step else "")
        rt.print(f"ddpkit: resuming from {path} ({where})")
    return pos


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


def _epoch_line(r: dict[str, Any], epochs: int) -> str:
    width = len(str(epochs))
    parts = [f"epoch {r['epoch']:>{width}}/{epochs}", f"train_loss {r['train_loss']:.4f}"]
    parts += [f"{k} {v:.4f}" for k, v in r.items() if k.startswith("eval_")]
    return "  ".join(parts)
