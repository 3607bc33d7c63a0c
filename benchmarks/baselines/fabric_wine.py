"""The Wine work (and the MLP workload) with Lightning Fabric: strategy "ddp", CPU, gloo.

    python benchmarks/baselines/fabric_wine.py --workload {wine,mlp} [--nproc 2]

Fabric's "ddp" launcher re-runs this script as a subprocess for each extra rank (this
process becomes rank 0), so the world size is --nproc; it is printed in RESULT and checked.

Wine: the guide's data and model (common.py), DataLoader(batch 32, shuffle=True) through
fabric.setup_dataloaders (DistributedSampler injected, set_epoch done by Fabric), global
mean loss, padding-free evaluation (test[rank::world] + all_reduce), fabric.save of the
model after epochs 50 and 100. MLP: tasks/mlp.py, batch 256 per process,
samples/s over the whole epoch (steady_samples_per_s: after --warmup steps). 1 intra-op thread per process (--threads).
"""

import time

_T0 = time.perf_counter()

import argparse
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402


def _wine(args, fabric, loss_fn):
    train_set, test_set = common.wine_data()
    model = common.wine_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(DataLoader(train_set, batch_size=common.WINE_BATCH, shuffle=True))
    ckpt_dir = common.save_dir(args.save_dir)

    model.train()
    t = time.perf_counter()
    for epoch in range(common.WINE_EPOCHS):
        loss_sum, n = 0.0, 0
        for xb, yb in loader:
            opt.zero_grad()
            loss = loss_fn(model(xb), yb)
            fabric.backward(loss)
            opt.step()
            loss_sum += loss.item() * len(xb)
            n += len(xb)
        if (epoch + 1) % common.WINE_SAVE_EVERY == 0:
            fabric.save(os.path.join(ckpt_dir, f"model_{epoch + 1}.pt"), {"model": model})
    train_s = time.perf_counter() - t

    rank, world = fabric.global_rank, fabric.world_size
    tot = fabric.all_reduce(torch.tensor([loss_sum, float(n)], dtype=torch.float64), reduce_op="sum")
    model.eval()
    xt = torch.tensor(test_set.data[rank::world], dtype=torch.float32)
    yt = torch.tensor(test_set.targets[rank::world], dtype=torch.long)
    with torch.no_grad():
        correct = (model(xt).argmax(1) == yt).sum().item() if len(xt) else 0
    acc = fabric.all_reduce(torch.tensor([float(correct), float(len(xt))], dtype=torch.float64), reduce_op="sum")
    train_s = fabric.all_reduce(torch.tensor([train_s], dtype=torch.float64), reduce_op="max").item()
    return {
        "samples_per_s": common.WINE_EPOCHS * len(train_set) / train_s,
        "train_s": train_s,
        "final_loss": (tot[0] / tot[1]).item(),
        "test_acc": (acc[0] / acc[1]).item(),
        "samples_per_epoch_seen": int(tot[1].item()),
    }


def _mlp(args, fabric, loss_fn):
    task = common.load_mlp_task()
    x, y = task.make_data(args.samples)
    model = task.make_model()
    opt = task.make_optimizer(model)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=task.BATCH_PER_PROCESS, shuffle=True))

    model.train()
    steps, all_samples, timed_samples, t_timed = 0, 0, 0, None
    t = time.perf_counter()
    for xb, yb in loader:
        if steps == args.warmup:
            fabric.barrier()
            t_timed = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(model(xb), yb)
        fabric.backward(loss)
        opt.step()
        steps += 1
        all_samples += len(xb)
        if t_timed is not None:
            timed_samples += len(xb)
    end = time.perf_counter()
    if t_timed is None:
        raise SystemExit(f"only {steps} steps: need more than --warmup {args.warmup}")
    r = fabric.all_reduce(torch.tensor([end - t, end - t_timed], dtype=torch.float64), reduce_op="max")
    s = fabric.all_reduce(
        torch.tensor([float(timed_samples), loss.item(), float(all_samples)], dtype=torch.float64), reduce_op="sum"
    )
    return {
        "samples_per_s": s[2].item() / r[0].item(),  # whole loop, warm-up included (= ddpkit's)
        "steady_samples_per_s": s[0].item() / r[1].item(),  # after the warm-up steps
        "train_s": r[0].item(),
        "timed_s": r[1].item(),
        "steps": steps,
        "warmup_steps": args.warmup,
        "final_loss": s[1].item() / fabric.world_size,
    }


def main():
    p = argparse.ArgumentParser(description="Wine / MLP with Lightning Fabric (ddp, CPU)")
    p.add_argument("--workload", choices=["wine", "mlp"], default="wine")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    p.add_argument("--samples", type=int, default=None, help="mlp data set size (default: tasks/mlp.py)")
    p.add_argument("--warmup", type=int, default=common.WARMUP_STEPS, help="mlp untimed steps")
    p.add_argument("--save-dir", default=None)
    args = p.parse_args()
    if args.save_dir is None:  # one directory for all ranks (each rank re-runs this script)
        args.save_dir = os.environ.setdefault("BENCH_SAVE_DIR", common.save_dir(None))

    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=args.nproc, num_nodes=1)
    fabric.launch()
    torch.set_num_threads(args.threads)
    loss_fn = nn.CrossEntropyLoss()
    res = (_wine if args.workload == "wine" else _mlp)(args, fabric, loss_fn)
    world = fabric.world_size
    fabric.barrier()
    if fabric.global_rank == 0:
        common.emit(
            _T0, world_size=world, threads=torch.get_num_threads(), workload=args.workload, strategy="ddp", **res
        )
    if world != args.nproc:
        print(f"ERROR: world size {world}, expected --nproc {args.nproc}", file=sys.stderr, flush=True)
        raise SystemExit(3)


if __name__ == "__main__":
    main()
