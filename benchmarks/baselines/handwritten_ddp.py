"""A clean hand-written DDP training loop: what a careful person writes without a library.

    torchrun --standalone --nproc-per-node N benchmarks/baselines/handwritten_ddp.py \
        --workload {wine,mlp} [--threads 1] [--no-sync] [--loader {dataloader,index}] \
        [--samples N] [--warmup 5] [--bucket-view] [--save-dir DIR] \
        [--device {cpu,cuda}] [--precision {fp32,bf16}] [--batch-size B] [--epochs E] [--data-on-device]
        [--wine-batch B] [--wine-epochs E]

(`python -m torch.distributed.run` is the same as `torchrun`.) gloo on CPU, 1 intra-op
thread per process by default (--threads), DistributedSampler with set_epoch, global
loss and a padding-free distributed evaluation.

wine: the guide's work (see common.py), 100 epochs, rank 0 saves after epochs 50 and 100,
      test accuracy at the end (--wine-batch per process and --wine-epochs change the guide's
      32 and 100: benchmarks/scale.py's step-time runs). --loader dataloader (default) uses the guide's per-item
      Dataset + DataLoader(sampler=DistributedSampler); --loader index draws the same
      sampler indices but slices in-memory tensors (no per-item __getitem__/collate).
mlp:  benchmarks/tasks/mlp.py (9.46M params, SGD lr 0.01), batch 256 per process, one
      pass over the data set (default 15360 samples = 30 steps at 2 processes, 60 at 1);
      samples_per_s covers the whole loop (as ddpkit reports it), steady_samples_per_s
      leaves out the first --warmup steps. --no-sync runs every step
      under model.no_sync(): no gradient all-reduce at all, the no-communication bound
      (replicas drift apart; the loss is then meaningless as DDP training).
      --bucket-view passes gradient_as_bucket_view=True to DDP (ddpkit's setting), so
      that `ddpkit train --grad-sync backend` and this loop run identical DDP settings.
      --device cuda (mlp only): NCCL, one GPU per process (LOCAL_RANK), DDP(device_ids=...),
      each batch gathered on the CPU and copied to the GPU (non_blocking), as ddpkit's loader
      does; --data-on-device keeps the whole data set on the GPU instead (no host gather or
      copy: the upper bound of the data path). Step times are bracketed by
      torch.cuda.synchronize(). --precision bf16: forward and loss under
      torch.autocast(device, bfloat16), fp32 weights and gradients (ddpkit's --precision bf16
      under DDP). --batch-size (per process, default 256) and --epochs (passes over the data
      set, default 1; --warmup counts steps from the first pass).

Last line: RESULT {"world_size", "threads", "samples_per_s", "train_s", "wall_s",
"final_loss", ...}. samples_per_s counts real samples of all processes per second of
train_s (the training loop, slowest rank).
"""

import time

_T0 = time.perf_counter()

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def batches_by_index(sampler, x, y, batch_size):
    idx = torch.tensor(list(iter(sampler)), dtype=torch.long, device=x.device)  # where the data is
    for i in range(0, len(idx), batch_size):
        b = idx[i : i + batch_size]
        yield x[b], y[b]


def run_wine(args, model_ctx, rank, world):
    train_set, test_set = common.wine_data()
    model = DDP(common.wine_model())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    if args.loader == "dataloader":
        loader = DataLoader(train_set, batch_size=args.wine_batch, sampler=sampler)
        epoch_batches = lambda: loader  # noqa: E731
    else:
        x = torch.tensor(train_set.data, dtype=torch.float32)
        y = torch.tensor(train_set.targets, dtype=torch.long)
        epoch_batches = lambda: batches_by_index(sampler, x, y, args.wine_batch)  # noqa: E731
    ckpt_dir = common.save_dir(args.save_dir)

    model.train()
    t = time.perf_counter()
    steps = 0
    for epoch in range(args.wine_epochs):
        sampler.set_epoch(epoch)
        loss_sum, n = 0.0, 0
        for xb, yb in epoch_batches():
            opt.zero_grad(set_to_none=True)
            with model_ctx(model):
                loss = loss_fn(model(xb), yb)
                loss.backward()
            opt.step()
            steps += 1
            loss_sum += loss.item() * len(xb)
            n += len(xb)
        if (epoch + 1) % common.WINE_SAVE_EVERY == 0 and rank == 0:
            torch.save(model.module.state_dict(), os.path.join(ckpt_dir, f"model_{epoch + 1}.pt"))
    train_s = time.perf_counter() - t

    # global mean loss of the last epoch (sample-weighted, all ranks)
    tot = torch.tensor([loss_sum, float(n)], dtype=torch.float64)
    dist.all_reduce(tot)
    # evaluation: each rank takes test[rank::world] (no padding, nothing counted twice)
    model.eval()
    xt = torch.tensor(test_set.data[rank::world], dtype=torch.float32)
    yt = torch.tensor(test_set.targets[rank::world], dtype=torch.long)
    with torch.no_grad():
        correct = (model.module(xt).argmax(1) == yt).sum().item() if len(xt) else 0
    acc = torch.tensor([float(correct), float(len(xt))], dtype=torch.float64)
    dist.all_reduce(acc)
    ts = torch.tensor([train_s], dtype=torch.float64)
    dist.all_reduce(ts, op=dist.ReduceOp.MAX)
    train_s = ts.item()
    return {
        "samples_per_s": args.wine_epochs * len(train_set) / train_s,
        "steps": steps,
        "train_s": train_s,
        "final_loss": (tot[0] / tot[1]).item(),
        "test_acc": (acc[0] / acc[1]).item(),
        "loader": args.loader,
    }


def run_mlp(args, model_ctx, rank, world, device):
    task = common.load_mlp_task()
    x, y = task.make_data(args.samples)
    if args.data_on_device:
        x, y = x.to(device), y.to(device)
    ids = [device.index] if device.type == "cuda" else None
    model = DDP(task.make_model().to(device), device_ids=ids, gradient_as_bucket_view=args.bucket_view)
    opt = task.make_optimizer(model)
    loss_fn = nn.CrossEntropyLoss()
    bs = args.batch_size or task.BATCH_PER_PROCESS
    sampler = DistributedSampler(range(len(x)), shuffle=True, seed=0)
    autocast = (
        (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
        if args.precision == "bf16"
        else contextlib.nullcontext
    )

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    prof = common.StepProfile.from_env(rank, world)  # DDPKIT_PROFILE_STEPS: ddpkit's labels on this loop
    label = prof.label if prof is not None else common.no_label

    model.train()
    steps, all_samples, timed_samples, t_timed = 0, 0, 0, None
    sync()
    t = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        batches = batches_by_index(sampler, x, y, bs)
        for xb, yb in batches if prof is None else prof.around(batches, steps):
            if steps == args.warmup:
                sync()
                dist.barrier()
                t_timed = time.perf_counter()
            with label("step.run"):
                if xb.device != device:
                    xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
                with label("step.optimizer"):
                    opt.zero_grad(set_to_none=True)
                with model_ctx(model):
                    with label("step.forward"), autocast():
                        loss = loss_fn(model(xb), yb)
                    with label("step.backward"):
                        loss.backward()
                with label("step.optimizer"):
                    opt.step()
            steps += 1
            all_samples += len(xb)
            if t_timed is not None:
                timed_samples += len(xb)
    sync()
    end = time.perf_counter()
    if prof is not None:
        prof.close()
    if t_timed is None:
        raise SystemExit(f"only {steps} steps: need more than --warmup {args.warmup}")
    r = torch.tensor([end - t, end - t_timed], dtype=torch.float64, device=device)
    dist.all_reduce(r, op=dist.ReduceOp.MAX)
    s = torch.tensor([float(timed_samples), loss.item(), float(all_samples)], dtype=torch.float64, device=device)
    dist.all_reduce(s)
    return {
        "samples_per_s": s[2].item() / r[0].item(),  # whole loop, warm-up included (= ddpkit's)
        "steady_samples_per_s": s[0].item() / r[1].item(),  # after the warm-up steps
        "train_s": r[0].item(),
        "timed_s": r[1].item(),
        "steps": steps,
        "warmup_steps": args.warmup,
        "final_loss": s[1].item() / world,
        "no_sync": args.no_sync,
        "device": str(device),
        "precision": args.precision,
        "batch_size": bs,
        "epochs": args.epochs,
        "data_on_device": args.data_on_device,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=["wine", "mlp"], required=True)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per process (default 1)")
    p.add_argument("--no-sync", action="store_true", help="every step under model.no_sync()")
    p.add_argument("--loader", choices=["dataloader", "index"], default="dataloader", help="wine only")
    p.add_argument("--samples", type=int, default=None, help="mlp data set size (default: tasks/mlp.py)")
    p.add_argument("--warmup", type=int, default=common.WARMUP_STEPS, help="mlp untimed steps")
    p.add_argument("--bucket-view", action="store_true", help="mlp: DDP(gradient_as_bucket_view=True)")
    p.add_argument("--save-dir", default=None)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="mlp: cuda = NCCL, one GPU per process")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="mlp: bf16 = autocast(bfloat16)")
    p.add_argument("--batch-size", type=int, default=None, help="mlp: per process (default: tasks/mlp.py's 256)")
    p.add_argument("--epochs", type=int, default=1, help="mlp: passes over the data set (default 1)")
    p.add_argument(
        "--data-on-device", action="store_true", help="mlp: keep the data set on the device (no host gather/copy)"
    )
    p.add_argument("--wine-batch", type=int, default=common.WINE_BATCH, help="wine: batch per process")
    p.add_argument("--wine-epochs", type=int, default=common.WINE_EPOCHS, help="wine: epochs")
    args = p.parse_args()

    torch.set_num_threads(args.threads)  # before the first op creates the pool
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun --standalone --nproc-per-node N ...")
    if args.workload == "wine" and (args.device != "cpu" or args.precision != "fp32"):
        raise SystemExit("--device cuda and --precision bf16 are for --workload mlp")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)  # before the process group, as NCCL wants
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model_ctx = (lambda m: m.no_sync()) if args.no_sync else (lambda m: contextlib.nullcontext())
    res = (
        run_wine(args, model_ctx, rank, world)
        if args.workload == "wine"
        else run_mlp(args, model_ctx, rank, world, device)
    )
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        common.emit(_T0, world_size=world, threads=torch.get_num_threads(), workload=args.workload, **res)


if __name__ == "__main__":
    main()
