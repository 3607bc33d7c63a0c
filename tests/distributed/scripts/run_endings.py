"""Wine runs that end in the ways `ddpkit runs` tells apart (selected by name)."""

import os
import signal
import time
from pathlib import Path

import torch

from ddpkit.tasks.wine import build as wine


def signals_itself(config=None):
    """Wine that sends itself SIGUSR1 after its first epoch: with --save-on-signal USR1 the run
    saves at the next step and stops, as under SLURM's time-limit warning."""
    task = wine(config)
    task.on_metrics = lambda record: os.kill(os.getpid(), signal.SIGUSR1) if record["epoch"] == 1 else None
    return task


class Fails:
    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, out, y):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("the task's loss failed at its third call")
        return self.inner(out, y)


def fails_at_step_3(config=None):
    task = wine(config)
    task.loss_fn = Fails(task.loss_fn)
    return task


class DiesOnceTracked(torch.nn.Module):
    """Rank 0 dies outright (os._exit) at its 5th forward, once its MLflow run exists: a worker
    killed before it could end its tracker run (waits at most 2 minutes for the tracker)."""

    def __init__(self, inner, run_dir):
        super().__init__()
        self.inner, self.run_dir, self.calls = inner, Path(run_dir), 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 5 and os.environ.get("RANK") == "0":
            deadline = time.monotonic() + 120
            while not (self.run_dir / "tracker-mlflow.json").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            os._exit(3)
        return self.inner(x)

    def state_dict(self, *args, **kwargs):
        return self.inner.state_dict(*args, **kwargs)


def rank_0_dies(config=None):
    task = wine(config)
    task.model = DiesOnceTracked(task.model, config.run_dir)
    return task
