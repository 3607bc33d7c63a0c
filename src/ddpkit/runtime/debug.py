"""--debug-collectives: torch's own check that the ranks run matching collectives.

With TORCH_DISTRIBUTED_DEBUG=DETAIL, torch wraps every process group's backend in a
ProcessGroupWrapper that, before each collective, compares its op, shapes, dtypes and sequence
number across the ranks (over a helper gloo group) and raises "Detected mismatch between
collectives on ranks" naming both, instead of hanging or silently reducing the wrong tensors.

Two things stood between the flag and that check:
  * torch reads the variable once, when torch.distributed is imported: a worker forked from a
    launcher that imported torch before setting it runs with the check off, silently.
    apply_debug_level() reads it again before the process group starts.
  * DDP's constructor crashes (SIGSEGV) on gloo under DETAIL in this torch (2.13): its usage
    logging, c10d::Logger::set_env_variables (called by Logger.set_construction_data_and_log),
    static_casts the group's gloo backend to ProcessGroupGloo to read its thread count, and
    under DETAIL that backend is the wrapper (measured: one nn.Linear, two ranks, gdb's
    backtrace ends in set_env_variables; INFO, which does not wrap, works). That call only
    fills DDP's usage-logging record (torch's `_get_ddp_logging_data()`: module name, bucket
    sizes, environment), so under DETAIL torch's Logger is replaced by a subclass that skips
    it; everything else DDP does, and the collective checks, stay torch's own.
"""

from __future__ import annotations

import os
from typing import Any

DEBUG_VAR = "TORCH_DISTRIBUTED_DEBUG"


def apply_debug_level() -> None:
    """Make TORCH_DISTRIBUTED_DEBUG (as it is now) torch's level, and let DDP run under DETAIL."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    if os.environ.get(DEBUG_VAR):
        dist.set_debug_level_from_env()
    if dist.get_debug_level() == dist.DebugLevel.DETAIL and not getattr(dist.Logger, "_ddpkit_skips_usage", False):
        dist.Logger = _logger_without_usage_record(dist.Logger)


def _logger_without_usage_record(torch_logger: Any) -> Any:
    class Logger(torch_logger):  # type: ignore[misc, valid-type]
        """torch's DDP Logger without the construction-time usage record that crashes under DETAIL."""

        _ddpkit_skips_usage = True

        def set_construction_data_and_log(self, *args: Any, **kwargs: Any) -> None:
            return None

    return Logger
