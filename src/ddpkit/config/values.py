"""The syntax of flag values: process counts, sizes, KEY=VALUE task arguments. Used by
the sections' checks and the CLI; imports nothing of ddpkit but the error type."""

from __future__ import annotations

import re
from typing import Any

from ..errors import DdpkitError


def parse_nproc(value: str) -> int | None:
    """--nproc N|auto|cpu (None: auto; cpu: one per CPU core, as torchrun's --nproc-per-node cpu)."""
    if value == "auto":
        return None
    if value == "cpu":
        import os

        return os.cpu_count() or 1
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"must be a positive integer or 'auto', got {value!r}") from None
    if n < 1:
        raise ValueError(f"must be a positive integer or 'auto', got {value!r}")
    return n


def parse_task_arg(text: str) -> tuple[str, Any]:
    """--task-arg KEY=VALUE: VALUE as a Python literal (4, 0.1, True, None, 'x', [1, 2]), else the text itself."""
    import ast

    key, sep, value = text.partition("=")
    if not sep or not key.strip().isidentifier():
        raise ValueError(f"must be KEY=VALUE with KEY a Python name, got {text!r}")
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        parsed = value
    return key.strip(), parsed


_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_memory(text: str | int | None, flag: str = "--device-memory") -> int | None:
    """--device-memory (or another size `flag`): '80GiB' (2^30 bytes), '80GB' (10^9), '512MB', or a number of bytes."""
    if text is None or isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m and _UNITS.get(m.group(2).lower())
    if not m or unit is None or float(m.group(1)) <= 0:
        raise DdpkitError(f"{flag} must be a size such as 80GiB, 80GB or 512MB, got {text!r}")
    return int(float(m.group(1)) * unit)


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


class BatchPlan:
    """How one optimizer step's global batch is cut at a world size: `global_batch` samples,
    rank r's share the r-th of an even split (shares differ by at most one), each share cut
    into `accumulate` micro-batches of at most `micro` samples.

    Without a fixed global batch it is world x --batch-size x --accumulate (the guide's rule:
    it grows with the world). With --global-batch-size G it is G at every world size and the
    accumulation is what a share of ceil(G / world) needs in micro-batches of at most
    --batch-size: recomputed at every (re)start, so a run that changes world size keeps its
    sequence of global batches."""

    def __init__(self, batch_size: int, accumulate: int, global_batch_size: int | None, world_size: int) -> None:
        self.world_size = world_size
        self.micro = batch_size
        if global_batch_size is None:
            self.global_batch, self.accumulate, self.fixed = world_size * batch_size * accumulate, accumulate, False
            return
        if global_batch_size < world_size:
            raise DdpkitError(
                f"--global-batch-size {global_batch_size} is smaller than the {world_size} processes: every process "
                f"needs at least one sample per step; use --global-batch-size {world_size} or more, or fewer processes"
            )
        share = -(-global_batch_size // world_size)
        self.global_batch, self.accumulate, self.fixed = global_batch_size, -(-share // batch_size), True

    def share(self, rank: int) -> int:
        """Rank `rank`'s samples of a full global batch."""
        base, extra = divmod(self.global_batch, self.world_size)
        return base + (1 if rank < extra else 0)

    def describe(self) -> str:
        if not self.fixed:
            return f"global batch {self.global_batch}"
        return f"global batch {self.global_batch} fixed: {self.share(0)} per process" + (
            f" in {self.accumulate} micro-batches of at most {self.micro}" if self.accumulate > 1 else ""
        )


def parse_batch_size(text: str | int) -> int | str:
    """--batch-size: a number of samples, or auto (the memory plan's largest that fits)."""
    if isinstance(text, int) or text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise DdpkitError(f"--batch-size must be a positive integer or auto, got {text!r}") from None
