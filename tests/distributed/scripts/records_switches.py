"""A Wine-sized task whose build() writes, in every worker, what --deterministic switches:
torch's switches and the cuBLAS workspace variable, to OUT/rank-R.json (--task-arg out=DIR)."""

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ddpkit.tasks import wine


def build(config=None, out="."):
    rank = dist.get_rank() if dist.is_initialized() else 0
    seen = {
        "algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }
    (Path(out) / f"rank-{rank}.json").write_text(json.dumps(seen))
    return wine.build(config)
