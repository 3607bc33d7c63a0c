"""A map-style task whose model writes down the ids it trains on (one line per micro-batch, to
RUN_DIR/ids-rank{R}.txt), so a test can count how often every sample was trained in an epoch.
SGD without momentum: a step's result depends only on the samples it sees, not on rounding
amplified by an adaptive optimizer."""
import os
from pathlib import Path

import torch
from torch import nn

import ddpkit


class Items(torch.utils.data.Dataset):
    """n samples {"x": 4 floats, "y": class, "id": index}: a plain map-style set of dicts."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(11)
        self.x = torch.randn(n, 4, generator=g, dtype=torch.float64)
        self.y = (self.x.sum(1) > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "id": torch.tensor(i)}


class IdModel(nn.Module):
    def __init__(self, log):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
        self.log = log

    def forward(self, x, y, id):
        if self.training and self.log is not None and len(id):
            with open(self.log, "a") as f:
                f.write(" ".join(str(i) for i in id.tolist()) + "\n")
        logits = self.net(x)
        return {"logits": logits, "loss": nn.functional.cross_entropy(logits, y)}


def build(config=None, n: int = 90, lr: float = 0.1):
    rank = int(os.environ.get("RANK", "0"))
    log = Path(config.run_dir) / f"ids-rank{rank}.txt" if config is not None and config.run_dir else None
    return ddpkit.Task(model=IdModel(log), train_set=Items(n), optimizer=lambda p: torch.optim.SGD(p, lr=lr))
