"""model.pt written tensor by tensor (checkpoint/streamed.py): the file torch.save writes, read by
torch.load and ddpkit's own checks, made while holding one whole tensor at a time."""

from __future__ import annotations

import zipfile

import pytest
import torch
from torch import nn

from ddpkit.checkpoint.file import load_file
from ddpkit.checkpoint.streamed import save_streamed


def _model() -> nn.Module:
    m = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10), nn.LayerNorm(10))
    m[1].weight = m[0].weight  # tied: one storage under two names
    m.register_buffer("count", torch.tensor(3))
    return m


def _records(path) -> list[str]:
    return sorted(n.split("/", 1)[1] for n in zipfile.ZipFile(path).namelist())


def test_the_file_is_torch_saves_and_holds_one_whole_tensor_at_a_time(tmp_path):
    state = _model().state_dict()
    live, held = [], []

    def gather(t: torch.Tensor) -> torch.Tensor:
        held.append(len(live))  # how many gathered tensors are still alive when the next one comes
        whole = t.clone()
        live.append(torch.utils.weak.WeakTensorKeyDictionary())
        live[-1][whole] = True
        return whole

    save_streamed(tmp_path / "m.pt", state.items(), gather, lambda t: tuple(t.shape), write=True)
    torch.save(state, tmp_path / "ref.pt")
    assert _records(tmp_path / "m.pt") == _records(tmp_path / "ref.pt")  # tied weights: one record
    back = torch.load(tmp_path / "m.pt", weights_only=True)
    assert list(back) == list(state) and all(torch.equal(back[k], state[k]) for k in state)
    assert back["0.weight"].data_ptr() == back["1.weight"].data_ptr()
    assert load_file(tmp_path / "m.pt").keys() == state.keys()  # every record's CRC-32 checks
    assert all(sum(len(d) for d in live[:n]) == 0 for n in held)  # each dropped before the next


def test_a_rank_that_does_not_write_gathers_the_same_tensors_in_the_same_order(tmp_path):
    state = _model().state_dict()
    order = []
    save_streamed(tmp_path / "m.pt", state.items(), lambda t: order.append(t.shape) or t, lambda t: t.shape, False)
    assert not (tmp_path / "m.pt").exists() and len(order) == len(state) - 1  # the tied weight once


def test_a_failed_write_leaves_nothing_and_still_takes_part_in_every_gather(tmp_path):
    state = _model().state_dict()
    gathered = []

    def gather(t: torch.Tensor) -> torch.Tensor:
        gathered.append(t.shape)
        if len(gathered) == 2:
            raise OSError(28, "No space left on device")
        return t

    with pytest.raises(OSError, match="No space left"):
        save_streamed(tmp_path / "m.pt", state.items(), gather, lambda t: t.shape, True)
    assert len(gathered) == len(state) - 1  # the rest drained: no other rank is left waiting
    assert list(tmp_path.iterdir()) == []  # no model.pt, no temporary file
