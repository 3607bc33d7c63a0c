#!/usr/bin/env python
"""Where FSDP's step goes on CPU ranks, against DDP's: the GPT row of run.py (examples/gpt.py,
4 blocks x 128, windows of 128, batch 16 per process, AdamW, clip 1.0), FSDP variants built
side by side in one job and timed interleaved (A B C ... A B C ...), then one step of DDP
and of FSDP profiled with torch.profiler.

    PYTHONPATH=src python -m ddpkit launch --nproc 2 benchmarks/fsdp_profile.py [--steps 8] [--rounds 3]

Per variant, rank 0 prints the median per optimizer step of the CPU time of this process
(every thread: the training thread and gloo's), and of the wall time; the machine is shared,
so CPU time is the figure to compare. Variants (what FSDP2 offers to trade memory or
communication for speed):
  ddp             DDP (gloo all-reduce), the reference
  fsdp            ddpkit's FsdpStrategy as it is (one unit per block, then the root; the
                  optimizer steps the local shards, strategies/local_step.py)
  fsdp-keep-last  the last block keeps its parameters gathered after forward (backward needs them next)
  fsdp-keep-all   no block frees its parameters after forward: backward all-gathers nothing
  fsdp-prefetch   explicit forward and backward prefetch of the next block
  fsdp-keep-last-prefetch  both
  ddp-fused, fsdp-fused  AdamW's fused kernel (--fused-optimizer on): one op over every tensor
  fsdp-dtensor-step  the optimizer stepping the DTensors (before ddpkit stepped the local shards)
  fsdp-root-only  one unit: the root holds every parameter (one all-gather, one reduce-scatter)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import ddpkit
from ddpkit.parallel.spec import StrategyConfig
from ddpkit.strategies import DdpStrategy
from ddpkit.strategies.fsdp import FsdpStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig, adamw_with_decay_groups  # noqa: E402

SIZES = dict(vocab_size=103, block_size=128, n_layer=4, n_head=4, n_embd=128)
BATCH = 16


def build(rt, variant):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SIZES))
    if variant == "ddp":  # the reference: gloo's all-reduce, as FSDP's collectives
        strategy = DdpStrategy(rt, StrategyConfig(name="ddp", grad_sync="backend"))
    elif variant == "ddp-fused":
        strategy = DdpStrategy(rt, StrategyConfig(name="ddp", grad_sync="backend"))
    elif variant == "fsdp-root-only":
        strategy = FsdpStrategy(rt, StrategyConfig(name="fsdp"), blocks=lambda m: [])
    else:
        strategy = FsdpStrategy(rt, StrategyConfig(name="fsdp"))
    model = strategy.setup_module(model)
    blocks = list(getattr(model, "module", model).blocks)
    if variant in ("fsdp-keep-last", "fsdp-keep-last-prefetch"):
        blocks[-1].set_reshard_after_forward(False)
    elif variant == "fsdp-keep-all":
        model.set_reshard_after_forward(False, recurse=True)
    if variant in ("fsdp-prefetch", "fsdp-keep-last-prefetch"):
        for a, b in zip(blocks, blocks[1:], strict=False):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    factory = lambda ps: adamw_with_decay_groups(ps, lr=1e-3)  # noqa: E731
    if variant == "fsdp-dtensor-step":  # the optimizer as torch builds it: every op on DTensors
        from ddpkit.strategies.optimizers import make_optimizer

        return strategy, model, make_optimizer(factory, model, None)
    opt = strategy.setup_optimizer(factory, model)
    if variant.endswith("-fused"):
        from ddpkit.strategies.ddp_knobs import fuse_optimizer

        opt = fuse_optimizer(opt, "on", rt.device)
    return strategy, model, opt


def step(strategy, model, opt, idx):
    from torch.profiler import record_function

    with record_function("## forward"):
        _, loss = model(idx, targets=idx.roll(1, dims=1))
    with record_function("## backward"):
        loss.backward()
    with record_function("## clip_grad_norm"):
        strategy.clip_grad_norm(model, 1.0)
    with record_function("## optimizer step"):
        opt.step()
        opt.zero_grad(set_to_none=True)


def timed(rt, variant, steps, gen):
    strategy, model, opt = build(rt.runtime, variant)
    batches = [torch.randint(0, 103, (BATCH, 128), generator=gen) for _ in range(steps + 2)]
    for idx in batches[:2]:  # warm-up
        step(strategy, model, opt, idx)
    cpu, wall = [], []
    for idx in batches[2:]:
        rt.barrier()
        c0, w0 = time.process_time(), time.perf_counter()
        step(strategy, model, opt, idx)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return cpu, wall


def profile(rt, variant, gen):
    from torch.profiler import ProfilerActivity, profile

    strategy, model, opt = build(rt.runtime, variant)
    idx = torch.randint(0, 103, (BATCH, 128), generator=gen)
    for _ in range(2):
        step(strategy, model, opt, idx)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(strategy, model, opt, idx)
    averages = prof.key_averages()
    phases = [e for e in averages if e.key.startswith("## ")]
    lines = [f"{e.key[3:]:<16} {e.cpu_time_total / 1e3:8.1f} ms" for e in phases]
    table = averages.table(
        sort_by="self_cpu_time_total", row_limit=int(os.environ.get("ROWS", "18")), max_name_column_width=60
    )
    return "\n".join(lines) + "\n\n" + table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="ddp,fsdp,fsdp-keep-last,fsdp-keep-all,fsdp-prefetch,fsdp-root-only")
    ap.add_argument("--profile", default="ddp,fsdp", help="variants to profile one step of ('' for none)")
    args = ap.parse_args()
    variants = args.variants.split(",")
    gen = torch.Generator().manual_seed(1)
    with ddpkit.init(device="cpu", threads=1) as rt:
        results = {v: ([], []) for v in variants}
        for _ in range(args.rounds):
            for v in variants:
                cpu, wall = timed(rt, v, args.steps, gen)
                results[v][0].extend(cpu)
                results[v][1].extend(wall)
        ddp_cpu = statistics.median(results[variants[0]][0])
        rt.print(f"| variant | CPU ms/step (median) | wall ms/step | CPU ÷ {variants[0]} |")
        rt.print("|---|---|---|---|")
        for v in variants:
            c, w = statistics.median(results[v][0]), statistics.median(results[v][1])
            rt.print(f"| {v} | {1e3 * c:.1f} | {1e3 * w:.1f} | {c / ddp_cpu:.2f} |")
        for v in filter(None, args.profile.split(",")):
            table = profile(rt, v, gen)
            rt.print(f"\n### one step of {v}, rank 0, by self CPU time\n\n```\n{table}\n```")


if __name__ == "__main__":
    main()
