"""One task two ways: `build` is a ddpkit task (`ddpkit train THIS.py:build`), and `main()` trains
the same task in an own loop with rt.wrap / rt.autocast / rt.accumulate / rt.clip_grad_norm /
rt.save / rt.load, under `ddpkit launch` or plain torchrun. The tests compare the two models.

--own-fully-shard: shard with torch's own fully_shard after ddpkit.init() instead of rt.wrap.
"""
import argparse
import os
import random

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


def build(config=None):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=g)
    y = (x[:, :4].sum(dim=1) > x[:, 4:].sum(dim=1)).long()
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
    return ddpkit.Task(model=model, train_set=TensorDataset(x, y),
                       optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), loss_fn=nn.CrossEntropyLoss())


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--clip", type=float, default=None)
    p.add_argument("--own-fully-shard", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    with ddpkit.init() as rt:
        seed_all(0)  # as ddpkit train: the same model on every rank, then per-rank streams
        task = build()
        seed_all(1 + rt.rank)
        if args.own_fully_shard:
            from torch.distributed.fsdp import fully_shard

            model = task.model
            for layer in model:
                if any(True for _ in layer.parameters()):
                    fully_shard(layer)
            fully_shard(model)
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        else:
            model, opt = rt.wrap(task.model, task.optimizer, strategy=args.strategy, precision=args.precision)
        loader = rt.loader(task.train_set, batch_size=args.batch_size, seed=0)
        k = args.accumulate
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            for xb, yb in loader:
                xb, yb = xb.to(rt.device), yb.to(rt.device)
                for i, (xm, ym) in enumerate(zip(xb.chunk(k), yb.chunk(k), strict=True)):
                    with rt.accumulate(model, i, k):
                        with rt.autocast():
                            loss = task.loss_fn(model(xm), ym) * (len(xm) / len(xb))
                        loss.backward()
                if args.clip:
                    rt.clip_grad_norm(model, args.clip)
                opt.step()
                opt.zero_grad()
        os.makedirs(args.out, exist_ok=True)
        whole = os.path.join(args.out, "final.pt")
        shards = os.path.join(args.out, "final-sharded")
        rt.save(whole, model, opt, epochs=args.epochs)
        rt.save(shards, model, opt, sharded=True, epochs=args.epochs)
        # both load back into this model and optimizer (whatever wraps them) and into a fresh one
        expected = torch.load(whole, weights_only=True)["model"]
        assert rt.load(whole, model, opt) == {"epochs": args.epochs}
        assert rt.load(shards, model, opt) == {"epochs": args.epochs}
        fresh = build().model
        rt.load(shards, fresh)  # sharded save into a plain model (every rank reads the whole)
        for name, t in fresh.state_dict().items():
            assert torch.equal(t, expected[name]), name
        rt.print("reload ok")
        del model, opt, task


if __name__ == "__main__":
    main()
