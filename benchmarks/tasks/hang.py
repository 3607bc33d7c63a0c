"""Wine, with one rank that stops at one step and never comes back (benchmarks/scale.py
times how long the job takes to say so). HANG_RANK stops before its HANG_STEP-th forward
and writes the time it stopped to HANG_MARK, so that the report's delay is measured from
the moment the rank went silent, not from the start of the job."""

from __future__ import annotations

import os
import time

from torch import nn

from ddpkit.tasks.wine import build as wine


class StopsAt(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == int(os.environ["HANG_STEP"]) and os.environ.get("RANK", "0") == os.environ["HANG_RANK"]:
            with open(os.environ["HANG_MARK"], "w") as f:
                f.write(repr(time.time()))
            time.sleep(600)
        return self.inner(x)


def build(config=None):
    task = wine(config)
    task.model = StopsAt(task.model)
    return task
