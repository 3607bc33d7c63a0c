"""A training set of tensors kept on the device (data/placement.py): the same batches, in the
same order, as the host path, at any world size, global batch and resumed position; and the
rule that decides it (--data-on-device). On a CPU the device is the host: the path runs here."""

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from ddpkit import DdpkitError, ShardedLoader
from ddpkit.data.placement import DEVICE_SHARE, LOADER, ON_DEVICE, data_bytes, place_on_device

CPU = torch.device("cpu")
GPU = torch.device("cuda", 0)  # only a name here: nothing is put on it


def _data(n=53):
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 3, 2, generator=g), torch.randint(0, 5, (n,), generator=g))


def _steps(loader, epochs=(0, 1, 2)):
    out = []
    for epoch in epochs:
        loader.set_epoch(epoch)
        out += list(loader.iter_steps())
    return out


def _assert_same_steps(placed, host):
    assert len(placed) == len(host) > 0
    for (batch, n, total), (want, n_want, total_want) in zip(placed, host, strict=True):
        assert (n, total) == (n_want, total_want)
        assert len(batch) == len(want) == 2
        for a, b in zip(batch, want, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("options", [{}, {"shuffle": False}, {"global_batch": 11}])
def test_batches_indexed_on_the_device_equal_the_host_paths_in_order(world, options):
    data = _data()
    for rank in range(world):
        placed = ShardedLoader(data, 4, rank, world, seed=7, device=CPU, **options)
        host = ShardedLoader(data, 4, rank, world, seed=7, **options)
        assert (placed.data, host.data) == (ON_DEVICE, LOADER)
        assert len(placed) == len(host)
        _assert_same_steps(_steps(placed), _steps(host))


def test_a_resumed_epoch_continues_at_the_same_sample_on_the_device():
    data = _data()
    state = {"epoch": 1, "samples": 12, "global_batch": 12}  # 3 steps of 2 x 6, resumed by 3 ranks of 4
    for rank in range(3):
        loaders = [ShardedLoader(data, 4, rank, 3, seed=2, **extra) for extra in ({"device": CPU}, {})]
        for loader in loaders:
            loader.load(state)
        placed, host = (_steps(loader, epochs=(1, 2)) for loader in loaders)
        _assert_same_steps(placed, host)
        assert loaders[0].state() == loaders[1].state() == {"epoch": 2, "samples": 53, "global_batch": 12}


class Items(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor([float(i)]), torch.tensor(i)


def test_the_rule_places_tensors_that_take_a_small_share_of_the_device():
    data = TensorDataset(torch.zeros(100, 10), torch.zeros(100, dtype=torch.int64))  # 4,000 + 800 bytes
    assert data_bytes(data) == 4800
    fits = int(4800 / DEVICE_SHARE)
    assert place_on_device(data, "auto", GPU, fits)
    assert not place_on_device(data, "auto", GPU, fits - 10)  # over a tenth of the budget: the loader
    assert place_on_device(data, "on", GPU, 1)  # forced: whatever its size
    assert not place_on_device(data, "off", GPU, fits)
    assert place_on_device(data, "auto", CPU, None)  # the host is the device: nothing is copied
    assert not place_on_device(Items(), "auto", CPU, None)  # items made by __getitem__: the loader
    with pytest.raises(DdpkitError, match=r"--data-on-device on needs a training set of tensors .*Items.*auto"):
        place_on_device(Items(), "on", CPU, None)
