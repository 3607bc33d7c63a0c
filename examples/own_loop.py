"""Your own training loop, distributed by ddpkit. Run it with any of:

    ddpkit launch --nproc 2 examples/own_loop.py --epochs 5 --out runs/own
    torchrun --nproc-per-node 2 examples/own_loop.py --epochs 5 --out runs/own
    python examples/own_loop.py            # one process, no process group
"""
import argparse
import os

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16, help="per process")
    p.add_argument("--out", default="runs/own-loop")
    args = p.parse_args()

    with ddpkit.init() as rt:  # joins the job: process group, device, threads; torn down on exit
        torch.manual_seed(0)  # the same initial model on every rank
        x = torch.randn(256, 10, generator=torch.Generator().manual_seed(1))
        y = (x.sum(dim=1) > 0).long()
        model = rt.wrap(nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = rt.loader(TensorDataset(x, y), batch_size=args.batch_size, seed=0)
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)  # reshuffles identically on every rank
            total = 0.0
            for xb, yb in loader:
                xb, yb = xb.to(rt.device), yb.to(rt.device)
                loss = nn.functional.cross_entropy(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += loss.item()
            mean = ddpkit.mean_across_ranks(total / len(loader))  # the global mean, not rank 0's
            rt.print(f"epoch {epoch + 1}: loss {mean:.4f} (world size {rt.world_size})")
        os.makedirs(args.out, exist_ok=True)
        rt.save(os.path.join(args.out, "final.pt"), model, opt, epochs=args.epochs)
        del model, opt  # release what holds the process group before it is torn down


if __name__ == "__main__":
    main()
