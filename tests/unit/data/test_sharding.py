from itertools import pairwise

import torch
from torch.utils.data import Dataset, TensorDataset

from ddpkit import ShardedLoader
from ddpkit.data import eval_batches, global_order, split_even


def test_split_even_covers_everything_once():
    for count in range(0, 40):
        for parts in range(1, 7):
            spans = [split_even(count, parts, i) for i in range(parts)]
            assert spans[0][0] == 0 and spans[-1][1] == count
            assert all(a[1] == b[0] for a, b in pairwise(spans))
            sizes = [hi - lo for lo, hi in spans]
            assert max(sizes) - min(sizes) <= 1


def _rank_batches(n, batch, world, epoch, seed=0):
    out = []
    for r in range(world):
        loader = ShardedLoader(TensorDataset(torch.arange(n)), batch, r, world, seed=seed)
        loader.set_epoch(epoch)
        out.append([b[0].tolist() for b in loader])
    return out


def test_ranks_together_see_the_single_process_batches():
    """nproc x batch b reproduces 1 process x batch N*b: same samples in every step."""
    single = _rank_batches(142, 32, 1, epoch=3)[0]
    for world in (2, 4):
        per_rank = _rank_batches(142, 32 // world, world, epoch=3)
        assert [sum((per_rank[r][s] for r in range(world)), []) for s in range(len(single))] == single


def test_uneven_rest_is_kept_and_split_evenly():
    per_rank = _rank_batches(142, 10, 3, epoch=0)  # global batch 30: 4 full + 22
    last = [len(per_rank[r][-1]) for r in range(3)]
    assert last == [8, 7, 7]
    seen = sorted(i for r in range(3) for b in per_rank[r] for i in b)
    assert seen == list(range(142))  # nothing dropped, nothing repeated


def test_every_epoch_is_reshuffled_identically_on_all_ranks():
    orders = [global_order(100, e, seed=7) for e in range(3)]
    assert not torch.equal(orders[0], orders[1]) and not torch.equal(orders[1], orders[2])
    assert torch.equal(global_order(100, 1, seed=7), orders[1])  # another "rank" draws the same
    assert sorted(orders[2].tolist()) == list(range(100))


def test_more_ranks_than_samples_gives_empty_shares():
    per_rank = _rank_batches(3, 1, 5, epoch=0)
    assert [len(b[0]) for b in per_rank] == [1, 1, 1, 0, 0]


class ItemDataset(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.tensor([float(i)]), torch.tensor(i)


def test_item_datasets_give_the_same_batches_as_tensor_datasets():
    a = ShardedLoader(ItemDataset(), 4, 1, 2, seed=3)
    b = ShardedLoader(TensorDataset(torch.arange(10.0).unsqueeze(1), torch.arange(10)), 4, 1, 2, seed=3)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
    w = ShardedLoader(ItemDataset(), 4, 1, 2, seed=3, num_workers=1)
    assert [t[1].tolist() for t in w] == [t[1].tolist() for t in b]


def test_eval_shards_are_exact_without_padding():
    ds = TensorDataset(torch.arange(36))
    for world in (1, 2, 3, 5, 7):
        seen = [int(i) for r in range(world) for (b,) in eval_batches(ds, 4, r, world) for i in b]
        assert sorted(seen) == list(range(36))


def test_a_loader_state_resumes_at_the_same_sample_at_another_world_size():
    """rt.loader's position is a number of samples of the global order: 2 ranks stop after 3
    steps of 2 x 4; 3 ranks of batch 5 load that state and train each remaining sample once."""
    data = TensorDataset(torch.arange(50))
    first = [ShardedLoader(data, 4, r, 2, seed=3) for r in range(2)]
    seen = []
    states = []
    for loader in first:
        loader.set_epoch(1)
        it = loader.iter_steps()
        for _ in range(3):
            seen += next(it)[0][0].tolist()
        states.append(loader.state())
    assert states[0] == states[1] == {"epoch": 1, "samples": 24, "global_batch": 8}
    next_epoch = []
    for r in range(3):
        loader = ShardedLoader(data, 5, r, 3, seed=3)
        loader.load(states)
        loader.set_epoch(1)
        seen += [i for (batch,) in loader for i in batch.tolist()]
        loader.set_epoch(2)  # the next epoch starts at its beginning
        next_epoch += [i for (batch,) in loader for i in batch.tolist()]
    assert sorted(seen) == list(range(50))
    assert sorted(next_epoch) == list(range(50))
