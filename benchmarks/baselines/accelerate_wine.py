"""The Wine work (and the MLP workload) with Hugging Face Accelerate on CPU, 2 processes.

Two ways to launch, both really 2 processes (world size is printed in RESULT and checked
against --nproc):

  # notebook style: notebook_launcher forks the workers from this (already imported) process
  python benchmarks/baselines/accelerate_wine.py --workload wine --nproc 2

  # accelerate launch (torchrun underneath)
  accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
      --dynamo_backend no --main_process_port PORT \
      benchmarks/baselines/accelerate_wine.py --workload wine --nproc 2

  (PORT: a free port; `--main_process_port 0` picks one itself from accelerate 1.7 on.)

Trap: `accelerate launch --cpu --num_processes 2` starts ONE process (--cpu selects the
"simple" launcher, which ignores --num_processes); and `--multi_gpu` alone on a machine
without GPUs starts 2 processes that each train alone (world size 1, DistributedType.NO).
What works is `--multi_gpu` (the torchrun launcher) plus cpu=True in the script
(`Accelerator(cpu=True)`, as here; or ACCELERATE_USE_CPU=true in the environment).

Wine: the guide's data and model (common.py), DataLoader(batch 32, shuffle=True) prepared
by Accelerate (it shards per process and pads the last batch by wrapping around), global
mean loss, evaluation with gather_for_metrics (drops the padding), accelerator.save of the
unwrapped state_dict after epochs 50 and 100. MLP: tasks/mlp.py, batch 256 per process,
samples/s over the whole epoch (steady_samples_per_s: after --warmup steps). 1 intra-op
thread per worker (--threads).
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
from accelerate import Accelerator, notebook_launcher  # noqa: E402


def train(args):
    torch.set_num_threads(args.threads)
    accelerator = Accelerator(cpu=True)
    world = accelerator.num_processes
    loss_fn = nn.CrossEntropyLoss()
    if args.workload == "wine":
        res = _wine(args, accelerator, loss_fn)
    else:
        res = _mlp(args, accelerator, loss_fn)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        launcher = "notebook_launcher" if args._notebook else "accelerate launch"
        common.emit(
            _T0,
            world_size=world,
            threads=torch.get_num_threads(),
            workload=args.workload,
            launcher=launcher,
            distributed_type=str(accelerator.distributed_type),
            **res,
        )
    ok = world == args.nproc
    accelerator.end_training()
    if not ok:
        print(f"ERROR: world size {world}, expected --nproc {args.nproc}", file=sys.stderr, flush=True)
        raise SystemExit(3)


def _wine(args, accelerator, loss_fn):
    train_set, test_set = common.wine_data()
    model = common.wine_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(train_set, batch_size=common.WINE_BATCH, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=common.WINE_BATCH)
    model, opt, loader, test_loader = accelerator.prepare(model, opt, loader, test_loader)
    ckpt_dir = common.save_dir(args.save_dir)

    model.train()
    t = time.perf_counter()
    for epoch in range(common.WINE_EPOCHS):
        loss_sum, n = 0.0, 0
        for xb, yb in loader:
            opt.zero_grad()
            loss = loss_fn(model(xb), yb)
            accelerator.backward(loss)
            opt.step()
            loss_sum += loss.item() * len(xb)
            n += len(xb)
        if (epoch + 1) % common.WINE_SAVE_EVERY == 0:
            accelerator.save(
                accelerator.unwrap_model(model).state_dict(), os.path.join(ckpt_dir, f"model_{epoch + 1}.pt")
            )
    train_s = time.perf_counter() - t

    tot = accelerator.reduce(torch.tensor([loss_sum, float(n)], dtype=torch.float64), "sum")
    model.eval()
    correct, count = 0, 0
    with torch.no_grad():
        for xb, yb in test_loader:
            pred, yb = accelerator.gather_for_metrics((model(xb).argmax(1), yb))
            correct += (pred == yb).sum().item()
            count += len(yb)
    train_s = accelerator.reduce(torch.tensor([train_s], dtype=torch.float64), "max").item()
    return {
        "samples_per_s": common.WINE_EPOCHS * len(train_set) / train_s,
        "train_s": train_s,
        "final_loss": (tot[0] / tot[1]).item(),
        "test_acc": correct / count,
        "samples_per_epoch_seen": int(tot[1].item()),
    }


def _mlp(args, accelerator, loss_fn):
    task = common.load_mlp_task()
    x, y = task.make_data(args.samples)
    model = task.make_model()
    opt = task.make_optimizer(model)
    loader = DataLoader(TensorDataset(x, y), batch_size=task.BATCH_PER_PROCESS, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)

    model.train()
    steps, all_samples, timed_samples, t_timed = 0, 0, 0, None
    t = time.perf_counter()
    for xb, yb in loader:
        if steps == args.warmup:
            accelerator.wait_for_everyone()
            t_timed = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(model(xb), yb)
        accelerator.backward(loss)
        opt.step()
        steps += 1
        all_samples += len(xb)
        if t_timed is not None:
            timed_samples += len(xb)
    end = time.perf_counter()
    if t_timed is None:
        raise SystemExit(f"only {steps} steps: need more than --warmup {args.warmup}")
    r = accelerator.reduce(torch.tensor([end - t, end - t_timed], dtype=torch.float64), "max")
    s = accelerator.reduce(
        torch.tensor([float(timed_samples), loss.item(), float(all_samples)], dtype=torch.float64), "sum"
    )
    return {
        "samples_per_s": s[2].item() / r[0].item(),  # whole loop, warm-up included (= ddpkit's)
        "steady_samples_per_s": s[0].item() / r[1].item(),  # after the warm-up steps
        "train_s": r[0].item(),
        "timed_s": r[1].item(),
        "steps": steps,
        "warmup_steps": args.warmup,
        "final_loss": s[1].item() / accelerator.num_processes,
    }


def main():
    p = argparse.ArgumentParser(description="Wine / MLP with Hugging Face Accelerate (CPU)")
    p.add_argument("--workload", choices=["wine", "mlp"], default="wine")
    p.add_argument("--nproc", type=int, default=2, help="processes (notebook_launcher) / expected world size")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    p.add_argument("--samples", type=int, default=None, help="mlp data set size (default: tasks/mlp.py)")
    p.add_argument("--warmup", type=int, default=common.WARMUP_STEPS, help="mlp untimed steps")
    p.add_argument("--save-dir", default=None)
    p.add_argument(
        "--launcher",
        choices=["auto", "notebook", "external"],
        default="auto",
        help="notebook: fork --nproc workers with notebook_launcher; external: this process "
        "is a worker of `accelerate launch`/torchrun; auto: external when started by one",
    )
    args = p.parse_args()
    under_launcher = args.launcher == "external" or (
        args.launcher == "auto" and ("LOCAL_RANK" in os.environ or "ACCELERATE_MIXED_PRECISION" in os.environ)
    )
    args._notebook = not under_launcher
    if under_launcher:  # accelerate launch / torchrun: this process is one worker
        train(args)
    else:  # notebook style: fork the workers from here (torch and sklearn already imported)
        import sklearn.datasets  # noqa: E401,F401  (pre-fork import)

        notebook_launcher(train, args=(args,), num_processes=args.nproc, use_port=str(common.free_port()))


if __name__ == "__main__":
    main()
