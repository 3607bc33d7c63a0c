"""Wine in float64 with SGD and momentum, for the node-loss tests: a resumed run must give the
uninterrupted run's model; in float64 another summation order (4 ranks, then 2) changes it by
~1e-15, so only a wrong sample, batch or optimizer state could move it by 1e-5. The momentum
buffers make a lost optimizer state visible. WINE_STEP_SLEEP_S=S: every training forward sleeps S
seconds (a node that must still be training when another joins; the model is unchanged).
WINE_EXIT_STEP=N, WINE_EXIT_RANK=R: in the job's first attempt, rank R's Nth training forward
ends its process (os._exit(3)), as a worker that crashes."""

import dataclasses
import os
import time

import torch
from torch.utils.data import TensorDataset

from ddpkit.tasks.wine import build as wine


def build(config=None):
    task = wine(config)
    x, y = task.train_set.tensors
    ex, ey = task.eval_set.tensors
    model = task.model.double()
    pause = float(os.environ.get("WINE_STEP_SLEEP_S", "0"))
    if pause:
        model.register_forward_pre_hook(lambda module, args: time.sleep(pause) if module.training else None)
    exit_step = int(os.environ.get("WINE_EXIT_STEP", "0"))
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if exit_step and first_attempt and os.environ.get("RANK") == os.environ.get("WINE_EXIT_RANK", "0"):
        calls = [0]

        def maybe_exit(module, args):
            calls[0] += module.training
            if calls[0] == exit_step:
                os._exit(3)

        model.register_forward_pre_hook(maybe_exit)
    return dataclasses.replace(
        task,
        model=model,
        train_set=TensorDataset(x.double(), y),
        eval_set=TensorDataset(ex.double(), ey),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
    )
