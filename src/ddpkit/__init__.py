"""ddpkit: one PyTorch training task on 1 process, every GPU of a node, or many nodes.

The names below are imported on first use, so `ddpkit --help` (and anything that only
needs the CLI or the config) does not pay for importing torch (~1-2 s).
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "init": "ownloop.session",
    "train": "run.train",
    "launch": "launchers.script",
    "train_on_ray": "engines.ray",
    "memory_plan": "run.plan",
    "atomic_save": "checkpoint",
    "load_file": "checkpoint",
    "unwrap": "checkpoint",
    "RunConfig": "config",
    "load_config": "config.file",
    "ShardedLoader": "data",
    "eval_batches": "data",
    "DistEnv": "environments",
    "DdpkitError": "errors",
    "Runtime": "runtime",
    "all_sum": "runtime",
    "mean_across_ranks": "runtime",
    "Session": "ownloop.session",
    "wrap_model": "strategies",
    "Task": "task",
    "ShardedStream": "data",
    "read_lines": "data",
    "read_jsonl": "data",
    "read_tar": "data",
    "verify": "tools.verify",
    "notebook_launch": "run.notebook",
}
__all__ = sorted(_WHERE)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
