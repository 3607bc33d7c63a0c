"""scripts/gpu_check.py step 10: training steps without a host synchronisation.

Runs ddpkit's optimizer step (training/step.py) on an MLP, with the batches handed over by
training/prefetch.py as `ddpkit train` does, and the optimizer `ddpkit train` builds by default
(--fused-optimizer auto: AdamW's fused kernel on a GPU, which skips a non-finite step on the
device), and after a few warm-up steps (lazy CUDA and optimizer-state set-up, and the first
step's agreement, read on the host: training/step.py) runs --steps more under
torch.cuda.set_sync_debug_mode("error"): any synchronisation inside a step raises. None is
allowed: the agreement is read a step later from a pinned copy (training/deferred.py). With
--data-on-device the batches come from a TensorDataset kept on the device (data/placement.py)
as `ddpkit train` gathers them, over passes of 8 steps (each pass's order is copied over once).
On a CPU (--device cpu) the same steps run without the debug mode (the optimizer is not fused
there by default: the host reads the agreement, which on a CPU waits for nothing). Prints one
line; exit 0: none. The other paths, decided on the device by training/skipping.py: --plain-optimizer
(AdamW not fused: a snapshot put back where a step is skipped), --fp16 (GradScaler and autocast),
--fsdp (the parameters sharded, in a world of one process).

    python scripts/sync_check.py --device cuda [--steps 20] [--accumulate 2] [--data-on-device]
        [--plain-optimizer] [--fp16] [--fsdp]
"""

import argparse
import functools
import itertools
import sys

import torch
from torch import nn

from ddpkit import DistEnv, ShardedLoader
from ddpkit.config import StrategyConfig
from ddpkit.runtime import Runtime
from ddpkit.strategies import DdpStrategy
from ddpkit.strategies.ddp_knobs import is_fused
from ddpkit.strategies.fsdp import FsdpStrategy
from ddpkit.training.prefetch import Prefetcher
from ddpkit.training.step import StepRunner


def batches(n: int, size: int = 64):
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        yield (torch.randn(size, 32, generator=g), torch.randint(0, 4, (size,), generator=g)), size, size


def placed_batches(device: torch.device, size: int = 64):
    """Passes of 8 steps over a data set kept on `device`, without end."""
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8 * size, 32, generator=g), torch.randint(0, 4, (8 * size,)))
    loader = ShardedLoader(data, size, device=device)
    for epoch in itertools.count():
        loader.set_epoch(epoch)
        yield from loader.iter_steps()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--data-on-device", action="store_true", help="batches of a data set kept on the device")
    p.add_argument("--plain-optimizer", action="store_true", help="AdamW not fused (no found_inf)")
    p.add_argument("--fp16", action="store_true", help="autocast to fp16 with a gradient scaler")
    p.add_argument("--fsdp", action="store_true", help="FSDP's sharded parameters (a world of one process)")
    args = p.parse_args()
    if args.fsdp:
        import torch.distributed as dist

        dist.init_process_group(
            "nccl" if args.device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
        )
    with Runtime(DistEnv(), device=args.device, threads=1) as rt:
        return check(rt, args)


def check(rt: Runtime, args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4))
    config = StrategyConfig(name="fsdp" if args.fsdp else "ddp", precision="fp16" if args.fp16 else "fp32")
    strategy = (FsdpStrategy if args.fsdp else DdpStrategy)(rt, config)
    cuda = rt.device.type == "cuda"
    model = strategy.setup_module(model)
    factory = functools.partial(torch.optim.AdamW, lr=1e-3, **({"fused": False} if args.plain_optimizer else {}))
    opt = strategy.setup_optimizer(factory, model)
    if cuda and not args.plain_optimizer and not is_fused(opt):
        print(
            "sync_check: FAIL: --fused-optimizer auto did not fuse AdamW on the GPU (the step then reads on the host)"
        )
        return 1
    runner = StepRunner(
        rt, strategy, model, opt, nn.CrossEntropyLoss(), accumulate=args.accumulate, scaler=strategy.grad_scaler()
    )
    total = torch.zeros(2, dtype=torch.float64, device=rt.device)
    n = args.warmup + args.steps
    if args.data_on_device:
        source = itertools.islice(placed_batches(rt.device), n)
    else:
        source = Prefetcher(batches(n), rt.device)
    for i, (batch, n_local, n_global) in enumerate(source):
        if cuda and i == args.warmup:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            result = runner.run(batch, n_local, n_global, where=f"step {i + 1}")
        except RuntimeError as e:
            print(f"sync_check: FAIL: a host synchronisation inside step {i + 1}: {str(e).splitlines()[0]}")
            return 1
        total += result.loss_sum
    if cuda:
        torch.cuda.set_sync_debug_mode(0)
    runner.settle()  # the last step's agreement (a pass's end reads it so)
    loss, count = total.tolist()
    if not count or not torch.isfinite(torch.tensor(loss)):
        print(f"sync_check: FAIL: the steps trained no finite loss ({loss} over {count})")
        return 1
    debug = f"under set_sync_debug_mode('error') on {rt.device}" if cuda else f"on {rt.device} (no debug mode)"
    data = ", data on the device" if args.data_on_device else ""
    paths = {"found_inf": "by the optimizer's found_inf", "snapshot": "by a snapshot put back"}
    kind = ("fused " if is_fused(opt) else "plain ") + "AdamW" + (", fp16" if args.fp16 else "")
    kind += ", FSDP" if args.fsdp else ""
    if runner._how in paths:
        how = f"{kind}: the device decides {paths[runner._how]}, 0 host syncs a step"
    else:
        how = f"{kind}: the host reads the agreement each step (on a CPU it waits for nothing)"
    print(
        f"sync_check: {args.steps} steps (--accumulate {args.accumulate}{data}) {debug}, {how}; "
        f"mean loss {loss / count:.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
