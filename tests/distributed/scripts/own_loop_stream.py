"""An own loop over a stream with rt.loader: rank 0 writes every id the ranks took, per pass,
to the path given. 30 items of a plain IterableDataset, round-robin over the ranks."""
import json
import sys

import torch

import ddpkit


class Numbers(torch.utils.data.IterableDataset):
    def __iter__(self):
        return ({"x": torch.tensor([float(i)]), "id": torch.tensor(i)} for i in range(30))


with ddpkit.init(threads=1) as rt:
    loader = rt.loader(Numbers(), batch_size=4)
    passes = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        mine = [i for batch in loader for i in batch["id"].tolist()]
        passes.append(sorted(i for ids in rt.all_gather_object(mine) for i in ids))
    if rt.is_main:
        json.dump(passes, open(sys.argv[1], "w"))
