"""Pieces shared by handwritten_ddp.py, accelerate_wine.py and fabric_wine.py (not by the
guide copies, which stay self-contained).

Wine work, identical in all of them and to the guide: load_wine, train_test_split(0.2,
random_state=42), StandardScaler fit on train, per-item Dataset (float32/int64 via
torch.tensor), Linear(13,64)-ReLU-Linear(64,3), Adam(lr=1e-3), cross-entropy, batch 32
(per process), 100 epochs, a checkpoint every 50 epochs (after epochs 50 and 100, rank 0
only, unwrapped state_dict), evaluation of the test split at the end.

MLP work: benchmarks/tasks/mlp.py (the same file ddpkit's benchmark row trains).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

BENCH_DIR = Path(__file__).resolve().parents[1]

WINE_EPOCHS = 100
WINE_BATCH = 32
WINE_SAVE_EVERY = 50
WARMUP_STEPS = 5


def load_mlp_task():
    """benchmarks/tasks/mlp.py, loaded by path (no package needed)."""
    spec = importlib.util.spec_from_file_location("bench_tasks_mlp", BENCH_DIR / "tasks" / "mlp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class WineDataset(Dataset):
    def __init__(self, data, targets):
        self.data = data
        self.targets = targets

    def __len__(self):
        return len(self.data)

    def __getitem__(self, idx):
        return (torch.tensor(self.data[idx], dtype=torch.float), torch.tensor(self.targets[idx], dtype=torch.long))


def wine_model() -> nn.Module:
    return nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 3))


def wine_data():
    """(train_set, test_set, X_test tensor, y_test tensor) exactly as the guide builds them."""
    from sklearn.datasets import load_wine
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    wine = load_wine()
    x_tr, x_te, y_tr, y_te = train_test_split(wine.data, wine.target, test_size=0.2, random_state=42)
    scaler = StandardScaler().fit(x_tr)
    x_tr, x_te = scaler.transform(x_tr), scaler.transform(x_te)
    return WineDataset(x_tr, y_tr), WineDataset(x_te, y_te)


def save_dir(arg: str | None) -> str:
    """The user's folder as given, else a temporary one that this process removes when it
    exits (normally or by an exception): only the folder it made itself, never one it was handed."""
    d = arg or os.environ.get("BENCH_SAVE_DIR")
    if not d:
        d = temp_dir("bench_ckpt_")
    os.makedirs(d, exist_ok=True)
    return d


def temp_dir(prefix: str) -> str:
    d = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return d


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def emit(t0: float, **fields) -> None:
    """Print the machine-readable last line: RESULT {json}."""
    fields.setdefault("wall_s", time.perf_counter() - t0)
    print("RESULT " + json.dumps(fields), flush=True)


def no_label(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


class StepProfile:
    """DDPKIT_PROFILE_STEPS=A:B and DDPKIT_PROFILE_OUT=DIR as ddpkit reads them
    (src/ddpkit/training/profile.py; written again here: the baselines import nothing of
    ddpkit): global steps A..B-1 under torch.profiler, stepped at each data fetch so that a
    profiled step is a whole loop iteration, the step before A as its warm-up; each rank writes
    DIR/rank{R}.json and DIR/rank{R}.txt. `label` puts ddpkit's names on the loop's parts."""

    def __init__(self, first: int, end: int, out: str, rank: int, world: int) -> None:
        self.first, self.end, self.out, self.rank, self.world = first, end, Path(out), rank, world
        self.prof = None
        self.seen = 0

    @classmethod
    def from_env(cls, rank: int, world: int) -> StepProfile | None:
        steps, out = os.environ.get("DDPKIT_PROFILE_STEPS"), os.environ.get("DDPKIT_PROFILE_OUT")
        if not steps:
            return None
        first, end = (int(x) for x in steps.split(":"))
        if not out or not 1 <= first < end:
            raise SystemExit("DDPKIT_PROFILE_STEPS=A:B (1 <= A < B) needs DDPKIT_PROFILE_OUT=DIR")
        return cls(first, end, out, rank, world)

    @staticmethod
    def label(name: str) -> contextlib.AbstractContextManager:
        from torch.profiler import record_function

        return record_function(name)

    def around(self, batches, done: int = 0):
        """The batches (the first one for global step done + 1), each fetch labelled step.data."""
        from torch.profiler import record_function

        it, step = iter(batches), done + 1
        while True:
            self._at(step)
            with record_function("step.data"):
                item = next(it, None)
            if item is None:
                return
            yield item
            step += 1

    def _at(self, step: int) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        if step <= self.seen:
            return
        self.seen = step
        if self.prof is None:
            if self.first - 1 <= step < self.end:
                warmup = 1 if step < self.first else 0
                self.prof = profile(
                    activities=[ProfilerActivity.CPU]
                    + ([ProfilerActivity.CUDA] if torch.cuda.is_initialized() else []),
                    schedule=schedule(wait=0, warmup=warmup, active=self.end - step - warmup, repeat=1),
                    on_trace_ready=self._write,
                )
                self.prof.start()
            return
        self.prof.step()
        if step == self.end:
            self.close()

    def close(self) -> None:
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.stop()

    def _write(self, prof) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        stem = self.out / f"rank{self.rank}"
        prof.export_chrome_trace(f"{stem}.json")
        header = {"rank": self.rank, "world_size": self.world, "steps": [self.first, self.end]}
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
        Path(f"{stem}.txt").write_text(json.dumps(header) + "\n" + table + "\n")
