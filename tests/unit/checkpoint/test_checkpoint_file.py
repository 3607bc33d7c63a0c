import os
import pickle

import pytest
import torch
from torch import nn

from ddpkit import DdpkitError
from ddpkit.checkpoint import file as ck
from ddpkit.checkpoint import state as ck_state
from ddpkit.checkpoint.schema import Header
from ddpkit.checkpoint.sharded import find_any_resumable


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _ckpt(model, opt, epoch=1):
    header = Header(ck_state.Position(epoch), rng=[ck_state.rng_state()], world_size=1, config={"task": "t"})
    return {**header.to_dict(), "model": model.state_dict(), "optimizer": opt.state_dict()}


def test_atomic_save_leaves_no_temporary_and_loads_back(tmp_path):
    m = _model()
    path = ck.atomic_save(m.state_dict(), tmp_path / "sub" / "model.pt")
    assert os.listdir(path.parent) == ["model.pt"]
    loaded = ck.load_file(path)
    assert all(torch.equal(loaded[k], v) for k, v in m.state_dict().items())


def test_failed_save_keeps_the_previous_file(tmp_path):
    target = tmp_path / "model.pt"
    ck.atomic_save({"w": torch.ones(2)}, target)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("disk full, say")

    with pytest.raises(RuntimeError):
        ck.atomic_save({"w": Unpicklable()}, target)
    assert torch.equal(ck.load_file(target)["w"], torch.ones(2))
    assert os.listdir(tmp_path) == ["model.pt"]


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/ddpkit-pwned",))


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"model": Exploit()}, path)
    with pytest.raises(DdpkitError, match="refused to load"):
        ck.load_file(path)
    assert not os.path.exists("/tmp/ddpkit-pwned")


@pytest.mark.parametrize("content", [b"", b"\x00garbage\xff" * 100, pickle.dumps([1, 2])[:5]])
def test_truncated_or_random_files_are_named_in_the_error(tmp_path, content):
    path = tmp_path / "bad.pt"
    path.write_bytes(content)
    with pytest.raises(DdpkitError, match="bad.pt"):
        ck.load_file(path)


def test_rng_state_round_trips_through_a_weights_only_file(tmp_path):
    import random

    import numpy as np

    state = ck_state.rng_state()
    ck.atomic_save(state, tmp_path / "rng.pt")
    expect = (torch.rand(3), random.random(), np.random.rand())
    ck_state.set_rng_state(ck.load_file(tmp_path / "rng.pt"))
    assert torch.equal(torch.rand(3), expect[0]) and random.random() == expect[1] and np.random.rand() == expect[2]


def test_resume_picks_the_newest_valid_checkpoint_and_reports_the_bad_one(tmp_path):
    m = _model()
    opt = torch.optim.Adam(m.parameters())
    ck.atomic_save(_ckpt(m, opt, 2), ck.checkpoint_path(tmp_path, 2))
    ck.checkpoint_path(tmp_path, 4).write_bytes(b"truncated")
    (tmp_path / "checkpoints" / ".epoch-000006.pt.x.tmp").write_bytes(b"half written")
    kind, state, path, skipped = find_any_resumable(tmp_path, m, opt)
    assert kind == "file"
    assert state["epoch"] == 2 and path.name == "epoch-000002.pt"
    assert len(skipped) == 1 and "epoch-000004.pt" in skipped[0]


def test_checkpoint_of_another_model_is_refused_with_what_mismatched(tmp_path):
    m = _model()
    ck.atomic_save(_ckpt(m, torch.optim.Adam(m.parameters())), ck.checkpoint_path(tmp_path, 1))
    other = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    with pytest.raises(DdpkitError, match=r"different model .*shape mismatch"):
        find_any_resumable(tmp_path, other, torch.optim.Adam(other.parameters()))


def test_checkpoint_with_another_optimizer_layout_is_refused(tmp_path):
    m = _model()
    ck.atomic_save(_ckpt(m, torch.optim.Adam(m.parameters())), ck.checkpoint_path(tmp_path, 1))
    groups = [{"params": list(m[0].parameters())}, {"params": list(m[2].parameters())}]
    with pytest.raises(DdpkitError, match="optimizer"):
        find_any_resumable(tmp_path, m, torch.optim.Adam(groups))


def test_no_checkpoint_says_how_to_start_fresh(tmp_path):
    with pytest.raises(DdpkitError, match="run without --resume"):
        find_any_resumable(tmp_path, _model(), None)


def test_what_killed_saves_left_is_removed_and_nothing_else(tmp_path):
    folder = tmp_path / "checkpoints"
    kept = [ck.atomic_save({"w": torch.ones(1)}, folder / "epoch-000002.pt")]
    kept += [folder / "epoch-000004", folder / "metrics.json", folder / ".notes"]
    kept[1].mkdir()
    kept[2].write_text("{}")
    kept[3].write_text("the user's")
    stale = [folder / ".epoch-000003.pt.k2j4.tmp", folder / ".epoch-000006.partial", folder / ".epoch-000004.old"]
    stale[0].write_bytes(b"half")
    for d in stale[1:]:
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"half")
    assert sorted(ck.remove_stale_temporaries(tmp_path)) == sorted(stale)
    assert sorted(folder.iterdir()) == sorted(kept)
