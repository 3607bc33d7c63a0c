"""--keep-last and --keep-best (checkpoint/retention.py: prune) over a run's checkpoints of
both kinds: which stay, which go, and that temporaries of an interrupted save are not counted."""

import pytest

from ddpkit.checkpoint.retention import prune, record_metric


def _checkpoints(run_dir, *names):
    """`epoch-000001.pt` files (one-file kind) and `epoch-000002` folders (sharded kind)."""
    folder = run_dir / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        if name.endswith((".pt", ".tmp")):
            (folder / name).write_bytes(b"x")
        else:
            (folder / name).mkdir()
            (folder / name / ".metadata").write_bytes(b"x")
    return folder


def _left(folder):
    return sorted(p.name for p in folder.iterdir() if p.name != "metrics.json")


def test_keep_last_keeps_the_newest_of_both_kinds_by_position_not_by_name(tmp_path):
    folder = _checkpoints(
        tmp_path, "epoch-000001.pt", "epoch-000002.pt", "epoch-000002-step-000005.pt", "epoch-000003", "epoch-000004.pt"
    )
    gone = prune(tmp_path, keep=3)
    assert sorted(p.name for p in gone) == ["epoch-000001.pt", "epoch-000002.pt"]
    assert _left(folder) == ["epoch-000002-step-000005.pt", "epoch-000003", "epoch-000004.pt"]
    assert prune(tmp_path, keep=3) == []  # nothing more to do


def test_temporaries_of_an_interrupted_save_are_neither_counted_nor_deleted(tmp_path):
    folder = _checkpoints(
        tmp_path, "epoch-000001.pt", "epoch-000002.pt", ".epoch-000003.pt.tmp", ".epoch-000003.partial"
    )
    assert [p.name for p in prune(tmp_path, keep=1)] == ["epoch-000001.pt"]
    assert _left(folder) == [".epoch-000003.partial", ".epoch-000003.pt.tmp", "epoch-000002.pt"]


def test_without_keep_last_or_keep_best_nothing_is_deleted(tmp_path):
    folder = _checkpoints(tmp_path, "epoch-000001.pt", "epoch-000002.pt", "epoch-000003")
    assert prune(tmp_path, keep=None) == [] and prune(tmp_path / "no-such-run", keep=1) == []
    assert len(_left(folder)) == 3


@pytest.mark.parametrize("maximize, best", [(False, "epoch-000002.pt"), (True, "epoch-000003")])
def test_keep_best_keeps_the_best_by_the_recorded_metric_and_always_the_newest(tmp_path, maximize, best):
    folder = _checkpoints(
        tmp_path, "epoch-000001.pt", "epoch-000002.pt", "epoch-000003", "epoch-000004.pt", "epoch-000005.pt"
    )
    for name, value in [("epoch-000001", 0.5), ("epoch-000002", 0.1), ("epoch-000003", 0.9), ("epoch-000004", 0.4)]:
        record_metric(tmp_path, name, value)  # the newest has none recorded: it stays anyway, to resume from
    prune(tmp_path, keep=None, keep_best=1, maximize=maximize)
    assert _left(folder) == sorted([best, "epoch-000005.pt"])


def test_keep_last_and_keep_best_together_keep_the_union(tmp_path):
    folder = _checkpoints(tmp_path, *(f"epoch-00000{i}.pt" for i in range(1, 7)))
    for i, value in enumerate([0.3, 0.1, 0.2, 0.9, 0.8, 0.7], start=1):
        record_metric(tmp_path, f"epoch-00000{i}", value)
    prune(tmp_path, keep=2, keep_best=2)  # lowest is best
    assert _left(folder) == ["epoch-000002.pt", "epoch-000003.pt", "epoch-000005.pt", "epoch-000006.pt"]
