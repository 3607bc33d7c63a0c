"""benchmarks/tp_fsdp.py: its two variants train the same global batch, and a profiled step's
split counts overlapping collectives once."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"
sys.path.insert(0, str(BENCH))
import tp_fsdp  # noqa: E402


def _global_batch(flags: list[str], nproc: int) -> int:
    tp = int(flags[flags.index("--tp") + 1]) if "--tp" in flags else 1
    return int(flags[flags.index("--batch-size") + 1]) * nproc // tp


def test_the_variants_train_the_same_global_batch():
    for size in tp_fsdp.SIZES:
        runs = tp_fsdp.variants(size, 4)
        assert list(runs) == ["fsdp-4", "fsdp-x-tp-2x2"]
        assert len({_global_batch(flags, 4) for flags in runs.values()}) == 1


def test_a_steps_collectives_are_the_union_of_their_spans(tmp_path):
    events = [
        {"ph": "X", "name": "ProfilerStep#5", "ts": 0, "dur": 1000, "tid": 1},
        {"ph": "X", "name": "step.run", "ts": 10, "dur": 900, "tid": 1},
        {"ph": "X", "name": "c10d::allreduce_", "ts": 100, "dur": 200, "tid": 1},
        {"ph": "X", "name": "record_param_comms", "ts": 150, "dur": 200, "tid": 1},  # overlaps: 100..350 once
        {"ph": "X", "name": "_c10d_functional::wait_tensor", "ts": 500, "dur": 50, "tid": 1},
        {"ph": "X", "name": "c10d::allreduce_", "ts": 0, "dur": 999, "tid": 7},  # another thread: not rank 0's wait
        {"ph": "X", "name": "fsdp::all_gather_copy_out", "ts": 600, "dur": 100, "tid": 1},  # a copy, not a wait
    ]
    trace = tmp_path / "rank0.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    split = tp_fsdp.split_of(trace)
    assert split["wall"] == 1.0 and split["run"] == 0.9
    assert split["collectives"] == 0.3  # 250 us + 50 us
