"""examples/tp_gpt.py at a tiny size, recording the bytes every collective of each rank sends
(runtime/traffic.py), per optimizer step: rank R writes OUT/rank-R.json, a list with one entry per
step of {"ranks of a process group": bytes sent in it since the step before}."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import tp_gpt  # noqa: E402

from ddpkit.runtime.traffic import TrafficRecorder  # noqa: E402

SIZES = dict(vocab=64, block_size=16, n_layer=2, n_head=4, n_embd=32, samples=96)


def build(config=None, out: str = ""):
    task = tp_gpt.build(config, **SIZES)
    if not out or "RANK" not in os.environ:
        return task
    recorder = TrafficRecorder()
    recorder.__enter__()  # on for the rest of this worker: every collective of every step
    Path(out).mkdir(parents=True, exist_ok=True)
    path, steps, last = Path(out) / f"rank-{os.environ['RANK']}.json", [], {}
    make = task.optimizer

    def after_step(opt, *_):
        now = recorder.totals()
        steps.append({",".join(map(str, k)): v - last.get(k, 0.0) for k, v in now.items()})
        last.update(now)
        path.write_text(json.dumps(steps))

    def optimizer(params):
        opt = make(params)
        if sum(len(g["params"]) for g in opt.param_groups) > 1:  # not the plan's one-tensor probe
            opt.register_step_post_hook(after_step)
        return opt

    task.optimizer = optimizer
    return task
