"""Tasks with real faults for the fault-injection tests (selected by environment variables)."""
import os
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddpkit.tasks.wine import build as wine


class ExitAfter(nn.Module):
    """Wraps a model; on the first attempt (no restart yet), rank FAULT_RANK calls os._exit
    at its FAULT_STEP-th forward: a worker dying from inside, mid-epoch. With FAULT_HANG=1
    it sleeps for 10 minutes there instead: a worker that hangs."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if (first_attempt and self.calls == int(os.environ.get("FAULT_STEP", "0"))
                and os.environ.get("RANK", "0") == os.environ.get("FAULT_RANK", "0")):
            if os.environ.get("FAULT_HANG"):
                time.sleep(600)
            os._exit(3)
        return self.inner(x)

    def state_dict(self, *args, **kwargs):  # same keys as the plain Wine model
        return self.inner.state_dict(*args, **kwargs)

    def load_state_dict(self, state, *args, **kwargs):
        return self.inner.load_state_dict(state, *args, **kwargs)


def exits_midway(config=None):
    task = wine(config)
    task.model = ExitAfter(task.model)
    return task


def nan_sample(config=None):
    """Wine with one training sample full of NaN: the step that draws it has a NaN loss."""
    task = wine(config)
    x, y = task.train_set.tensors
    x = x.clone()
    x[7] = float("nan")
    task.train_set = TensorDataset(x, y)
    return task


def big(config=None):
    """A model whose checkpoints take a while to write (~100 MB with Adam's state)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2048, generator=g)
    y = torch.randint(0, 4, (64,), generator=g)
    model = nn.Sequential(nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 4))
    return {"model": model, "train_set": TensorDataset(x, y), "optimizer": lambda p: torch.optim.Adam(p, lr=1e-4)}


def seven_mb(config=None):
    """A model whose checkpoint is ~7 MB (plain SGD keeps no state): the third fills a 20 MiB disk."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1024, generator=g)
    y = torch.randint(0, 4, (64,), generator=g)
    model = nn.Sequential(nn.Linear(1024, 1700), nn.ReLU(), nn.Linear(1700, 4))
    return {"model": model, "train_set": TensorDataset(x, y), "optimizer": lambda p: torch.optim.SGD(p, lr=1e-3)}


def crash_in_save(config=None):
    """Wine, but checkpoint save number DDPKIT_TEST_CRASH_AT_SAVE dies (SIGKILL) halfway
    through writing its temporary file, as a node losing power mid-save would."""
    import signal

    import torch

    crash_at = int(os.environ.get("DDPKIT_TEST_CRASH_AT_SAVE", "0"))
    real_save = torch.save
    calls = {"n": 0}

    def dying_save(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("format") == "ddpkit-checkpoint" and hasattr(f, "write"):
            calls["n"] += 1
            if calls["n"] == crash_at:
                f.write(b"half a checkpoint")
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        return real_save(obj, f, *args, **kwargs)

    torch.save = dying_save
    return wine(config)


def _faulty_rank():
    return os.environ.get("RANK", "0") == os.environ.get("FAULT_RANK", "0")


class SkipsAllReduce(nn.Module):
    """Every forward sums a number over the ranks with ddpkit.all_sum; rank FAULT_RANK skips
    it at its FAULT_STEP-th forward: a collective the other ranks wait in forever."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x):
        import ddpkit

        self.calls += 1
        if not (self.calls == int(os.environ.get("FAULT_STEP", "0")) and _faulty_rank()):
            ddpkit.all_sum(torch.ones(3))  # the collective rank FAULT_RANK skips once
        return self.inner(x)

    def state_dict(self, *args, **kwargs):
        return self.inner.state_dict(*args, **kwargs)


def skips_all_reduce(config=None):
    task = wine(config)
    task.model = SkipsAllReduce(task.model)
    return task


class StuckItems(torch.utils.data.Dataset):
    """Wine's training set read item by item; on rank FAULT_RANK the FAULT_STEP-th item read
    never returns (a stuck file system, a dead data server)."""

    def __init__(self, inner):
        self.inner = inner
        self.reads = 0

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        self.reads += 1
        if self.reads == int(os.environ.get("FAULT_STEP", "0")) and _faulty_rank():
            while True:
                time.sleep(1)  # stuck reading this item
        return self.inner[i]


def stuck_in_getitem(config=None):
    task = wine(config)
    task.train_set = StuckItems(task.train_set)
    return task


def refuses_then_dies(config=None):
    """Rank 1 refuses its input with a DdpkitError on the first attempt, and on the restart
    dies outright (exit 3): the launcher must name the second failure, not the first's file."""
    from ddpkit.errors import DdpkitError

    if _faulty_rank():
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            raise DdpkitError("refused on the first attempt")
        os._exit(3)
    return wine(config)
