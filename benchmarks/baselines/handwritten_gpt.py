"""Hand-written torchrun DDP loop of the GPT example: what ddpkit's GPT row is compared with.

    torchrun --standalone --nproc-per-node 2 benchmarks/baselines/handwritten_gpt.py --samples 960

The same work as `ddpkit train examples/gpt.py:build --epochs 1 --clip-grad-norm 1.0`: the
model, the data windows, AdamW with its decay groups and the warm-up + cosine schedule are
imported from examples/gpt.py (nothing of ddpkit is imported); the loop is the one people
write: DataLoader + DistributedSampler over the dict items, `model(**batch)` returning
(logits, loss), backward, clip_grad_norm_(1.0), optimizer step, scheduler step. One pass
over --samples windows at --batch-size per process (960 windows = 30 steps at 2 processes
of 16). --no-sync runs every step under model.no_sync(): no gradient all-reduce at all, the
GPT's no-communication bound (the ceiling of any 2-process variant).

Last line: RESULT {"world_size", "threads", "samples_per_s", "steady_samples_per_s",
"train_s", "final_loss", ...}: samples_per_s over the whole loop (as ddpkit reports it),
steady_samples_per_s after the first --warmup steps.
"""

import time

_T0 = time.perf_counter()

import argparse
import contextlib
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import common  # noqa: E402
import gpt  # noqa: E402  (examples/gpt.py)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per process (default 1)")
    p.add_argument("--batch-size", type=int, default=16, help="windows per process per step (16)")
    p.add_argument("--samples", type=int, default=960, help="training windows (max_samples of the example)")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=10, help="the schedule's warm-up (the example's default)")
    p.add_argument("--warmup", type=int, default=common.WARMUP_STEPS, help="untimed steps for steady_samples_per_s")
    p.add_argument("--no-sync", action="store_true", help="every step under model.no_sync() (the compute bound)")
    return p.parse_args()


def main():
    args = _args()
    torch.set_num_threads(args.threads)  # before the first op creates the pool
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun --standalone --nproc-per-node N ...")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank (DDP broadcasts rank 0's anyway)

    train_set, _, vocab = gpt.char_data(args.block_size, args.samples)
    model = DDP(gpt.GPT(gpt.GPTConfig(len(vocab), args.block_size, args.n_layer, args.n_head, args.n_embd, 0.0)))
    opt = gpt.adamw_with_decay_groups(model.parameters(), lr=args.lr)
    total_steps = math.ceil(len(train_set) / (args.batch_size * world))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, gpt.warmup_cosine(args.warmup_steps, total_steps))
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    sampler.set_epoch(0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    prof = common.StepProfile.from_env(rank, world)  # DDPKIT_PROFILE_STEPS: ddpkit's labels on this loop
    label = prof.label if prof is not None else common.no_label

    model.train()
    steps, all_samples, timed_samples, t_timed = 0, 0, 0, None
    t = time.perf_counter()
    for batch in loader if prof is None else prof.around(loader):
        if steps == args.warmup:
            dist.barrier()
            t_timed = time.perf_counter()
        with label("step.run"):
            with model.no_sync() if args.no_sync else contextlib.nullcontext():
                with label("step.forward"):
                    _, loss = model(**batch)
                with label("step.backward"):
                    loss.backward()
            with label("step.optimizer"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
        steps += 1
        n = len(batch["idx"])
        all_samples += n
        if t_timed is not None:
            timed_samples += n
    end = time.perf_counter()
    if prof is not None:
        prof.close()
    if t_timed is None:
        raise SystemExit(f"only {steps} steps: need more than --warmup {args.warmup}")
    r = torch.tensor([end - t, end - t_timed], dtype=torch.float64)
    dist.all_reduce(r, op=dist.ReduceOp.MAX)
    s = torch.tensor([float(timed_samples), loss.item(), float(all_samples)], dtype=torch.float64)
    dist.all_reduce(s)
    dist.barrier()
    del model, opt, sched
    dist.destroy_process_group()
    if rank == 0:
        common.emit(
            _T0,
            world_size=world,
            threads=torch.get_num_threads(),
            workload="gpt",
            samples_per_s=s[2].item() / r[0].item(),
            steady_samples_per_s=s[0].item() / r[1].item(),
            train_s=r[0].item(),
            timed_s=r[1].item(),
            steps=steps,
            warmup_steps=args.warmup,
            final_loss=s[1].item() / world,
            no_sync=args.no_sync,
        )


if __name__ == "__main__":
    main()
