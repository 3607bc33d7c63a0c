"""The checkpointer on one process: what a checkpoint holds, when one is due, which stay,
and that a resume puts model, optimizer, parts and position back (several ranks and both
kinds: tests/distributed/)."""

import pytest
import torch
from torch import nn

from ddpkit import DdpkitError, DistEnv
from ddpkit.checkpoint.checkpointer import Checkpointer, Stateful
from ddpkit.checkpoint.file import load_file
from ddpkit.checkpoint.schema import position_of
from ddpkit.checkpoint.state import Position
from ddpkit.config.faults import Faults
from ddpkit.runtime import Runtime
from ddpkit.strategies import DdpStrategy


@pytest.fixture
def rt():
    with Runtime(DistEnv(), device="cpu", threads=1) as r:
        yield r


def _trained(seed=0):
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def _checkpointer(rt, tmp_path, model, opt, **faults):
    faults = {"save_every": 0, "snapshot_every_steps": 0, **faults}  # the final model only, no snapshots
    return Checkpointer(tmp_path, rt, DdpStrategy(rt), model, opt, Faults(**faults), {"task": "t"})


def test_a_checkpoint_holds_position_parts_and_state_and_a_resume_puts_them_back(rt, tmp_path):
    model, opt = _trained()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sched.step()
    saver = _checkpointer(rt, tmp_path, model, opt)
    saver.register("scheduler", Stateful(sched))
    saver.save(Position(2, samples=3, loss_sum=0.75, count_sum=3.0, global_step=25, global_batch=3))
    ckpt = load_file(tmp_path / "checkpoints" / "epoch-000002-step-000025.pt")  # named by the run's optimizer step
    assert (
        ckpt["epoch"],
        ckpt["samples"],
        ckpt["loss_sum"],
        ckpt["global_step"],
        ckpt["global_batch"],
        len(ckpt["rng"]),
    ) == (2, 3, 0.75, 25, 3, 1)
    assert ckpt["extra"]["scheduler"]["last_epoch"] == 1

    fresh, fresh_opt = _trained(seed=1)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.5)
    loader = _checkpointer(rt, tmp_path, fresh, fresh_opt)
    loader.register("scheduler", Stateful(fresh_sched))
    pos = loader.resume(required=True, data_size=10, global_batch=5, quiet=True)
    assert pos == Position(2, 3, 0.75, 3.0, 25, 3)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True))
    assert fresh_opt.state_dict()["param_groups"] == opt.state_dict()["param_groups"] and fresh_sched.last_epoch == 1
    assert all(
        fresh_opt.state[p]["momentum_buffer"].equal(opt.state[q]["momentum_buffer"])
        for p, q in zip(fresh.parameters(), model.parameters(), strict=True)
    )


def test_non_finite_weights_are_never_checkpointed(rt, tmp_path):
    model, opt = _trained()
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    with pytest.raises(DdpkitError, match="NaN/inf at epoch 4; no checkpoint written"):
        _checkpointer(rt, tmp_path, model, opt).save(Position(3))
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_a_part_the_checkpoint_has_and_the_run_lacks_is_refused_before_anything_loads(rt, tmp_path):
    model, opt = _trained()
    saver = _checkpointer(rt, tmp_path, model, opt)
    saver.register("scheduler", Stateful(torch.optim.lr_scheduler.StepLR(opt, step_size=1)))
    saver.save(Position(1))
    fresh, fresh_opt = _trained(seed=1)
    before = [t.clone() for t in fresh.state_dict().values()]
    with pytest.raises(DdpkitError, match="the checkpoint has an LR scheduler .* and the other does not"):
        _checkpointer(rt, tmp_path, fresh, fresh_opt).resume(required=True, data_size=10, global_batch=5, quiet=True)
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.state_dict().values(), strict=True))


def test_when_a_checkpoint_is_due(rt, tmp_path):
    model, opt = _trained()
    c = _checkpointer(rt, tmp_path, model, opt, save_every=5, save_every_steps=4)
    assert [s for s in range(1, 13) if c.due_after_step(s, signal=False, clock=False)] == [4, 8, 12]
    assert c.due_after_step(3, signal=True, clock=False) and c.due_after_step(3, signal=False, clock=True)
    assert [e for e in range(1, 12) if c.due_after_pass(e, 1, last=e == 11, stopping=False)] == [5, 10, 11]
    assert c.due_after_pass(2, 8, last=False, stopping=False)  # --save-every-steps at a pass's end
    assert c.due_after_pass(2, 1, last=False, stopping=True)  # a signal between passes
    final_only = _checkpointer(rt, tmp_path, model, opt, save_every=0)
    assert not final_only.due_after_pass(3, 3, last=True, stopping=False)


def test_keep_last_keeps_the_newest_complete_checkpoints(rt, tmp_path):
    model, opt = _trained()
    c = _checkpointer(rt, tmp_path, model, opt, keep_last=2)
    for epoch in (1, 2, 3):
        c.save(Position(epoch, global_step=epoch * 10))
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*.pt")) == ["epoch-000002.pt", "epoch-000003.pt"]


def test_async_saves_are_on_disk_when_writing_is_left_and_equal_blocking_ones(rt, tmp_path):
    model, opt = _trained()
    blocking = _checkpointer(rt, tmp_path / "a", model, opt)
    background = _checkpointer(rt, tmp_path / "b", model, opt, async_save=True)
    blocking.save(Position(1, global_step=3))
    with background.writing():
        background.save(Position(1, global_step=3))
    a, b = (load_file(d / "checkpoints" / "epoch-000001.pt") for d in (tmp_path / "a", tmp_path / "b"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["optimizer"]["state"][0]["momentum_buffer"].equal(b["optimizer"]["state"][0]["momentum_buffer"])


def test_a_place_kept_in_steps_becomes_samples_only_at_its_own_global_batch():
    old = {
        "epoch": 1,
        "step": 5,
        "loss_sum": 2.0,
        "count_sum": 40.0,
        "world_size": 2,
        "config": {"batch_size": 4, "accumulate": 1},
    }
    assert position_of(old, "p", data_size=90, global_batch=8) == Position(1, 40, 2.0, 40.0, 12 + 5, 8)
    assert position_of(old, "p", data_size=None, global_batch=3).samples == 40  # a stream: its shards say where
    with pytest.raises(
        DdpkitError,
        match=r"global batch of 8 \(2 processes x --batch-size 4 x --accumulate 1\); this "
        r"run's global batch is 4.*resume once with 2 processes",
    ):
        position_of(old, "p", data_size=90, global_batch=4)
    at_boundary = {**old, "step": 0}
    assert position_of(at_boundary, "p", data_size=90, global_batch=4) == Position(1, 0, 2.0, 40.0, 12, 8)
