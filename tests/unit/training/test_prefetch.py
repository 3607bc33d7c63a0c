"""training/prefetch.py on a CPU: the Prefetcher hands the items through as they are (the very
objects, in order, none taken twice), and expected_sync is a plain context."""

import torch

from ddpkit.training.prefetch import Prefetcher, expected_sync


def test_the_prefetcher_passes_a_cpus_items_through_in_order():
    items = [((torch.arange(3) + i, {"y": torch.ones(2) * i}), 3, 6) for i in range(4)]
    taken = []

    def source():
        for item in items:
            taken.append(item)
            yield item

    out = list(Prefetcher(source(), torch.device("cpu")))
    assert len(out) == len(taken) == 4
    assert all(a is b for a, b in zip(out, items, strict=True))  # the same objects: no copy on a CPU


def test_an_empty_source_gives_nothing_and_expected_sync_runs_its_block():
    assert list(Prefetcher(iter(()), torch.device("cpu"))) == []
    with expected_sync():
        value = torch.ones(2).sum().item()
    assert value == 2.0
