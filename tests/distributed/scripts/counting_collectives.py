"""Wine, counting the collectives this rank's record (runtime/record.py) holds between one
step's forward and the next: gradient buckets apart from the rest. Rank 0 writes the counts
of every such interval of the run to RUN_DIR/collectives.json after the first epoch."""

import json
from pathlib import Path

from ddpkit.runtime.group import Runtime
from ddpkit.runtime.record import where
from ddpkit.tasks.wine import build as wine


class Counting:
    def __init__(self, inner):
        self.inner, self.seen, self.intervals = inner, None, []

    def __call__(self, out, y):
        record = Runtime.active().collectives.record
        if self.seen is not None:
            new = [e for e in record if e.seq > self.seen]
            assert len(new) < record.entries.maxlen, "the record's ring overflowed between two steps"
            grads = sum(e.what == "gradient bucket" for e in new)
            others = [f"{e.describe()} at {where(e.caller)}" for e in new if e.what != "gradient bucket"]
            self.intervals.append({"gradient": grads, "other": len(others), "which": others})
        self.seen = record.seq
        return self.inner(out, y)


def build(config=None):
    task = wine(config)
    counting = task.loss_fn = Counting(task.loss_fn)
    out = Path(config.run_dir) / "collectives.json"

    def write(record):
        if record["epoch"] == 1:
            out.write_text(json.dumps(counting.intervals))

    task.on_metrics = write
    return task


def wide(config=None):
    """The same count over a model whose first gradient bucket is larger than
    strategies/agreement.py's CARRY_MAX: its 2048 x 2048 layer (4.2M elements) is in it."""
    import torch
    from torch import nn

    task = build(config)
    torch.manual_seed(0)
    task.model = nn.Sequential(nn.Linear(13, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 3))
    return task


def wide_nan(config=None):
    """`wide` with one training sample full of NaN: the step that draws it has a NaN loss on one rank."""
    from torch.utils.data import TensorDataset

    task = wide(config)
    x, y = task.train_set.tensors
    x = x.clone()
    x[7] = float("nan")
    task.train_set = TensorDataset(x, y)
    return task
