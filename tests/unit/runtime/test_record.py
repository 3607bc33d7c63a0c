"""ddpkit's record of the collectives a rank issued: numbered, with the line that called them."""

import sys

import torch

from ddpkit.runtime.record import CollectiveRecord


def test_entries_are_numbered_and_name_the_calling_line():
    record = CollectiveRecord(entries=3)
    for _ in range(4):
        with record.track("all_reduce", torch.zeros(2, 3), "backend"):
            line = sys._getframe().f_lineno
    assert [e.seq for e in record] == [2, 3, 4]  # a ring of the last 3
    last = list(record)[-1]
    assert last.state == "done" and last.as_dict()["shape"] == [2, 3] and last.as_dict()["dtype"] == "float32"
    assert last.as_dict()["caller"].endswith(
        f"test_record.py:{line - 1} in test_entries_are_numbered_and_name_the_calling_line"
    )
    assert record.pending() is None


def test_a_collective_that_raises_stays_pending_as_failed():
    record = CollectiveRecord()
    try:
        with record.track("all_reduce", torch.zeros(1), "shm", "gradient bucket"):
            raise RuntimeError("Timed out waiting 3000ms")
    except RuntimeError:
        pass
    pending = record.pending()
    assert pending is not None and pending.state == "failed: Timed out waiting 3000ms"
    assert pending.describe() == "all_reduce #1 (shape [1], float32, shm, gradient bucket)"
