"""Snapshots in a node's memory (checkpoint/snapshot.py, memory.py) on one process: the store
keeps the newest complete ones only, and a restart's resume takes whichever is newer, the
snapshot or the disk checkpoint (several nodes: tests/cluster/test_node_loss.py)."""

import os

import pytest
import torch
from torch import nn

from ddpkit import DistEnv
from ddpkit.checkpoint import snapshot
from ddpkit.checkpoint.checkpointer import Checkpointer
from ddpkit.checkpoint.snapshot import SnapshotStore
from ddpkit.checkpoint.state import Position
from ddpkit.config.faults import Faults
from ddpkit.runtime import Runtime
from ddpkit.strategies import DdpStrategy


def test_the_store_keeps_the_two_newest_complete_snapshots_and_ignores_a_partial_one(tmp_path):
    store = SnapshotStore(tmp_path / "node")
    for step in (2, 4, 6):
        store.write(step, {"w": torch.full((3,), float(step))})
    store.wait()
    (store.folder / ".snapshot-0000000008.pt.abc.tmp").write_bytes(b"half a file")  # a write cut short
    assert store.steps() == [4, 6] and store.newest() == 6
    assert torch.equal(store.read(6)["w"], torch.full((3,), 6.0))
    store.mark(7)
    assert store.progress()[0] == 7
    assert SnapshotStore(tmp_path / "empty").newest() is None and SnapshotStore(tmp_path / "empty").progress() is None


def test_the_end_removes_this_node_and_the_lost_nodes_of_the_job_only(tmp_path):
    mine = SnapshotStore(tmp_path / f"ddpkit-snapshots-job-{os.getpid()}")
    mine.mark(1)
    lost = tmp_path / "ddpkit-snapshots-job-999999999"  # no such process: a node that is gone
    alive = tmp_path / f"ddpkit-snapshots-job-{os.getppid()}"
    other_job = tmp_path / "ddpkit-snapshots-other-999999999"
    for folder in (lost, alive, other_job):
        folder.mkdir()
    mine.remove()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, other_job.name])


@pytest.fixture
def restarting(monkeypatch, tmp_path):
    """A worker of a job that torch's agent restarts, its snapshots under tmp_path."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "unit")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setattr(snapshot, "SHM", tmp_path / "shm")
    with Runtime(DistEnv(), device="cpu", threads=1) as rt:
        yield rt


def _run(rt, run_dir, every=2):
    torch.manual_seed(0)
    model = nn.Linear(4, 2).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return (
        model,
        opt,
        Checkpointer(run_dir, rt, DdpStrategy(rt), model, opt, Faults(save_every=0, snapshot_every_steps=every), {}),
    )


def _step(model, opt):
    opt.zero_grad()
    model(torch.ones(3, 4, dtype=torch.float64)).pow(2).sum().backward()
    opt.step()


def test_a_restart_resumes_from_the_newer_of_memory_and_disk(restarting, tmp_path):
    model, opt, ckpt = _run(restarting, tmp_path / "run")
    at_step = {}
    for step in range(1, 8):
        _step(model, opt)
        at_step[step] = {k: v.clone() for k, v in model.state_dict().items()}
        if step == 3:
            ckpt.save(Position(0, samples=3 * 16, global_step=3, global_batch=16))
        ckpt.snapshot(step, lambda step=step: Position(0, samples=step * 16, global_step=step, global_batch=16))
    ckpt.wait()
    assert ckpt.memory.store.steps() == [4, 6]  # every 2 steps, the newest 2

    fresh, _, restarted = _run(restarting, tmp_path / "run")
    pos = restarted.resume(required=False, data_size=160, global_batch=16, quiet=True)
    assert pos.global_step == 6 and pos.samples == 96
    assert all(torch.equal(fresh.state_dict()[k], at_step[6][k]) for k in at_step[6])
    r = restarted.memory.recovery
    assert (r["resumed_from"], r["resumed_step"], r["disk_checkpoint_step"], r["steps_redone"]) == ("memory", 6, 3, 1)

    ckpt.save(Position(0, samples=7 * 16, global_step=7, global_batch=16))  # now the disk is newer
    _, _, again = _run(restarting, tmp_path / "run")
    assert again.resume(required=False, data_size=160, global_batch=16, quiet=True).global_step == 7
    assert again.memory.recovery["resumed_from"] == "disk"

    again.end_snapshots()  # the run's normal end
    assert not ckpt.memory.store.folder.exists()


def test_snapshots_are_off_without_restarts_or_when_asked(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with Runtime(DistEnv(), device="cpu", threads=1) as rt:
        assert _run(rt, tmp_path, every=None)[2].snapshot_due() is False
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "unit")
        monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
        monkeypatch.setattr(snapshot, "SHM", tmp_path / "shm")
        assert _run(rt, tmp_path, every=0)[2].snapshot_due() is False
        assert _run(rt, tmp_path, every=None)[2].snapshot_due() is True


def test_a_snapshot_that_cannot_be_written_warns_and_the_training_goes_on(tmp_path, capsys):
    from ddpkit.checkpoint.memory import MemorySnapshots

    store = SnapshotStore(tmp_path / "node")
    store.folder.rmdir()
    store.folder.write_text("")  # a file where the folder should be: writes fail as on a full /dev/shm
    with Runtime(DistEnv(), device="cpu", threads=1) as rt:
        memory = MemorySnapshots(rt, 1, store)
        memory.after_step(1, lambda: {"w": torch.zeros(1)})
        memory.after_step(2, lambda: {"w": torch.zeros(1)})
    assert memory.store is None and memory.held() == {}
    assert capsys.readouterr().out.count("ddpkit: warning: cannot keep snapshots in") == 1


def test_a_sharded_store_keeps_each_ranks_two_newest_shards_in_the_nodes_folder(tmp_path):
    folder = tmp_path / "node"
    ranks = [SnapshotStore(folder, shard=(i, 2)) for i in range(2)]
    for step in (2, 4, 6):
        for i, store in enumerate(ranks):
            if step < 6 or i == 0:  # rank 1's write of step 6 never happened (it died)
                store.write(step, {"w": torch.full((2,), float(10 * step + i))})
    for store in ranks:
        store.wait()
    # each rank prunes its own: rank 0 dropped step 2, rank 1 (2 written) kept both
    assert ranks[0].shards() == [(2, 1, 2), (4, 0, 2), (4, 1, 2), (6, 0, 2)] == ranks[1].shards()
    assert torch.equal(ranks[1].read(4, (1, 2))["w"], torch.full((2,), 41.0))


def _offers(*nodes):
    """everyone's held() for ranks laid out node by node: nodes = [(ranks on it, its shard files)]."""
    return [{"shards": files} for n_ranks, files in nodes for _ in range(n_ranks)]


def test_the_shard_plan_takes_the_newest_step_whose_every_shard_some_node_holds():
    from ddpkit.checkpoint.memory import shard_plan

    full = [(4, 0, 2), (4, 1, 2), (6, 0, 2)]  # step 6's shard 1 is missing
    # one node of 2 ranks after the loss of the other (HSDP's surviving replica group): its own shards
    assert shard_plan(_offers((2, full)), 2) == (4, [0, 1])
    # a node that joined (ranks 0, 1 hold nothing): each takes its shard from the rank of the same
    # index on the node that holds them
    assert shard_plan(_offers((2, []), (2, full)), 2) == (4, [2, 3, 2, 3])
    # when several hold it, the lowest one; the ranks that hold theirs read their own
    assert shard_plan(_offers((2, full), (2, full)), 2) == (4, [0, 1, 2, 3])
    assert shard_plan(_offers((2, [])), 2) is None


def test_the_shard_plan_says_why_memory_cannot_serve():
    from ddpkit.checkpoint.memory import shard_plan

    # plain FSDP over 2 nodes: the lost node held shards 2 and 3
    lost = shard_plan(_offers((2, [(8, 0, 4), (8, 1, 4)])), 4)
    assert "no node holds shard(s) 2, 3 of 4 of the newest snapshot (step 8)" in lost and "hsdp" in lost
    # 4 shards in memory, the run now shards 2 ways (plain FSDP on the surviving node)
    other = shard_plan(_offers((2, [(8, i, 4) for i in range(4)])), 2)
    assert other == "the snapshots in memory hold 4 shards of each parameter and this run 2"
