"""The Wine task, with every collective FSDP2 issues on this rank written down: FSDP2 calls
torch.distributed.all_gather_single / reduce_scatter_single / all_reduce on its mesh's process
groups itself, past ddpkit's collective record (runtime/record.py), so this task wraps those three
functions and keeps the calls made from torch's FSDP code: op, the group's global ranks, and the
elements of the shard-sized side (all-gather's input, reduce-scatter's output, the all-reduced tensor).
Each rank writes RUN_DIR/collectives-RANK.json (its node: torchelastic's GROUP_RANK) while the
list grows, up to its first LIMIT calls (the first steps)."""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from ddpkit.tasks.wine import build as wine

LIMIT = 64
OPS = ("all_gather_single", "reduce_scatter_single", "all_reduce")


def _recording(op, fn, calls, out):
    def wrapper(*args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename
        if os.sep + "fsdp" + os.sep in caller and len(calls) < LIMIT:
            group = kwargs.get("group")
            tensor = _shard_side(op, args, kwargs)
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            calls.append({"op": op, "ranks": ranks, "numel": tensor.numel()})
            out.write_text(json.dumps({"rank": dist.get_rank(), "node": int(os.environ["GROUP_RANK"]), "calls": calls}))
        return fn(*args, **kwargs)

    wrapper.recording = True
    return wrapper


def _shard_side(op, args, kwargs):
    if op == "all_gather_single":
        return kwargs["input_tensor"] if "input_tensor" in kwargs else args[1]
    if op == "reduce_scatter_single":
        return kwargs["output"] if "output" in kwargs else args[0]
    return kwargs["tensor"] if "tensor" in kwargs else args[0]


def build(config):
    calls = []
    out = Path(config.run_dir) / f"collectives-{os.environ['RANK']}.json"
    for op in OPS:
        if not getattr(getattr(dist, op), "recording", False):
            setattr(dist, op, _recording(op, getattr(dist, op), calls, out))
    return wine(config)
