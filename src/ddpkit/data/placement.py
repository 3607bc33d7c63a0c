"""Where a training set's batches are gathered: on the device, from tensors placed there once,
or on the host by the loader (and copied to the device every step).

A data set of tensors (a TensorDataset: the built-in tasks', the MLP benchmark's, most small
in-memory sets) is batched by indexing its tensors with the step's sample indices. Gathering
that batch on the host and copying it over costs a GPU step time (1.22x fp32, 1.46x bf16 on
the MLP on an H200, benchmarks/gpu.py); kept on the device, the batch is one `index_select`
per tensor there, with the same indices in the same order: the same samples, bit for bit.

The rule (--data-on-device auto): a TensorDataset whose tensors take at most DEVICE_SHARE of
the rank's memory budget (--device-memory, else the device's own) is placed on the device;
on a CPU the device is the host, where the tensors already are, so any TensorDataset is
indexed where it lies. `on` places any TensorDataset whatever its size, and refuses any other
data set; `off` keeps the host path. Anything else (a data set with its own __getitem__, a
stream) goes through the loader: its items may be made afresh at every access (augmentation),
so they cannot be gathered once. DataLoader workers (--num-workers) never serve a data set of
tensors: a batch is one indexing op, which workers could only slow down by copying it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import TensorDataset

from ..errors import DdpkitError

DEVICE_SHARE = 0.10  # of a rank's memory budget: what a training set may take on the device
PLACEMENTS = ("auto", "on", "off")  # --data-on-device
ON_DEVICE, LOADER = "on device", "loader"  # the summary's "data": which path ran


def tensors_of(dataset: Any) -> tuple[torch.Tensor, ...] | None:
    """The data set's tensors, when its samples are their rows (a TensorDataset); else None."""
    return tuple(dataset.tensors) if isinstance(dataset, TensorDataset) else None


def data_bytes(dataset: Any) -> int:
    """What the data set's tensors hold, in bytes (0 when it is not tensors)."""
    return sum(t.numel() * t.element_size() for t in tensors_of(dataset) or ())


def place_on_device(dataset: Any, mode: str, device: torch.device, budget: int | None) -> bool:
    """Whether `dataset` is batched on `device` (see the module docstring); `budget`: the
    rank's memory in bytes (needed on a GPU under auto)."""
    if mode == "off":
        return False
    if tensors_of(dataset) is None:
        if mode == "on":
            raise DdpkitError(
                f"--data-on-device on needs a training set of tensors (a TensorDataset); this one is a "
                f"{type(dataset).__name__}: use --data-on-device auto (or off)"
            )
        return False
    if mode == "on" or device.type == "cpu":
        return True
    return budget is not None and data_bytes(dataset) <= DEVICE_SHARE * budget


def to_device_once(tensors: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """The data set's tensors on `device`, copied once (the same tensors on their own device)."""
    return tuple(t.to(device) for t in tensors)


def indices_to(order: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An epoch's sample order on `device`: queued from pinned memory, no host synchronisation
    (once per pass; the order is drawn on the host, as on every other path)."""
    if order.device == device:
        return order
    source = order.pin_memory() if device.type == "cuda" else order
    return source.to(device, non_blocking=True)
