"""An optimizer step that the device skips, for the optimizers that take no found_inf tensor
(torch's non-fused kernels), fp16's gradient scaler and FSDP's sharded parameters: the rest of
what lets a step run without a host synchronisation (training/step.py, deferred.py).

Why: without it the host must read the step's agreed flags before the optimizer step (is a
loss not finite? then the weights may not move), which waits for the GPU every step.

How, by path:
  * An optimizer that takes found_inf (torch's fused Adam/AdamW/SGD/Adagrad) over plain
    tensors: it skips its own update (step.py).
  * Any other optimizer of torch.optim whose state is all tensors (its step counts included),
    and every optimizer over DTensors (FSDP: each rank's local shards): the parameters and the
    state are copied before the step into buffers kept for the run, and put back after it where
    the device says skip (`torch.where`: bit for bit the values before). The cost: one more copy
    of the parameters and of the optimizer's state in memory, and three passes over them a step.
    On a CPU, where a read waits for nothing, the host decides instead (step.py), unless asked.
    On a GPU the Adam family keeps its step counts on the device (torch's `capturable`), which a
    skip can put back without reading them; its update then computes the bias corrections on the
    device (equal to the host's within rounding).
  * fp16's gradient scaler: the gradients are unscaled on the device (as GradScaler.unscale_
    does), the scaler's own overflow check joins the skip, and the scale's update is undone where
    the step was skipped for a loss not finite (the host path does not update it then).
"""

from __future__ import annotations

from typing import Any

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (where the copy and the select run); a tensor itself."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def state_is_tensors(optimizer: torch.optim.Optimizer) -> bool:
    """Can a snapshot hold everything a step changes? torch's optimizers, with tensor state only."""
    if not type(optimizer).__module__.startswith("torch.optim"):
        return False  # a custom optimizer may keep what a copy of its tensors misses
    return all(isinstance(v, torch.Tensor) for s in optimizer.state.values() for v in s.values())


def keep_step_counts_on_device(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """On a GPU: the Adam family's step counts on the device (capturable; those its first step
    made on the host are moved), so a skipped step can put them back without a read on the host."""
    from torch.optim.optimizer import _get_capturable_supported_devices

    if device.type not in _get_capturable_supported_devices():
        return
    for group in optimizer.param_groups:
        if "capturable" not in group or group.get("fused"):
            continue
        group["capturable"] = True
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].to(p.device)


class Snapshot:
    """The optimizer's parameters and tensor state, copied before a step into buffers made once,
    put back where the device says skip."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._live: list[torch.Tensor] = []
        self._copies: list[torch.Tensor] = []

    def _tensors(self) -> list[torch.Tensor]:
        params = params_of(self.optimizer)
        state = [v for p in params for v in self.optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        return [_local(t) for t in params + state]

    def take(self) -> None:
        live = self._tensors()
        if len(live) != len(self._live) or any(a is not b for a, b in zip(live, self._live, strict=True)):
            self._live, self._copies = live, [torch.empty_like(t) for t in live]
        with torch.no_grad():
            torch._foreach_copy_(self._copies, self._live)

    def restore_where(self, skip: torch.Tensor) -> None:
        with torch.no_grad():
            for live, copy in zip(self._live, self._copies, strict=True):
                live.copy_(torch.where(skip.to(live.device), copy, live))


def skipping_step(optimizer: torch.optim.Optimizer, skip: torch.Tensor, snapshot: Snapshot | None) -> None:
    """optimizer.step(), its effect undone on the device where `skip` (a bool tensor) is true:
    by the optimizer's found_inf when `snapshot` is None, else by the snapshot."""
    if snapshot is None:
        optimizer.found_inf = skip.to(torch.float32)  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]
        return
    snapshot.take()
    optimizer.step()
    snapshot.restore_where(skip)


def scaled_skipping_step(
    scaler: Any, optimizer: torch.optim.Optimizer, skip: torch.Tensor, snapshot: Snapshot | None, unscaled: bool
) -> None:
    """fp16: unscale (unless clipping did), step unless the scaler found an overflow or `skip`,
    update the scale; a `skip` leaves the scale and its growth count as they were."""
    if not unscaled:
        scaler.unscale_(optimizer)
    found = sum(f.to(skip.device) for f in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
    skipping_step(optimizer, skip | (found > 0), snapshot)
    scale, growth = scaler._scale.clone(), scaler._growth_tracker.clone()
    scaler.update()
    scaler._scale.copy_(torch.where(skip.to(scale.device), scale, scaler._scale))
    scaler._growth_tracker.copy_(torch.where(skip.to(growth.device), growth, scaler._growth_tracker))
