"""examples/deep_mlp.py's task, counting this rank's gradient reduce-scatters (FSDP2 calls
torch.distributed.reduce_scatter_single once per unit that syncs). Rank 0 writes the count
after every epoch to RUN_DIR/reduce_scatters.json."""
import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from deep_mlp import build as deep_mlp  # noqa: E402

CALLS = {"reduce_scatter": 0}


def _counting(fn):
    def wrapper(*args, **kwargs):
        CALLS["reduce_scatter"] += 1
        return fn(*args, **kwargs)
    return wrapper


def build(config):
    if not hasattr(dist.reduce_scatter_single, "__wrapped_by_test__"):
        dist.reduce_scatter_single = _counting(dist.reduce_scatter_single)
        dist.reduce_scatter_single.__wrapped_by_test__ = True
    task = deep_mlp(config)
    out = Path(config.run_dir) / "reduce_scatters.json"
    task.on_metrics = lambda record: out.write_text(json.dumps({"epoch": record["epoch"], **CALLS}))
    return task
