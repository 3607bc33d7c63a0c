"""Hand-written one-process loop of the GPT benchmark's workload (benchmarks/tasks/gpt_synth.py):
what ddpkit's rows in benchmarks/gpt_mfu.py are compared with.

    python benchmarks/baselines/handwritten_gpt_mfu.py --device cuda --batch-size 8 --steps 20 [--fast]

The loop people write for one GPU, at the settings of `ddpkit train ... --nproc 1
--clip-grad-norm 1.0` (ddpkit runs one process without a process group or DDP, so this
loop has none either): DataLoader (shuffled, pinned on a GPU) of the workload's windows,
`model(**batch)` -> (logits, loss), backward, clip_grad_norm_(1.0), AdamW step. --fast:
bf16 autocast, torch.compile of the model and fused AdamW (ddpkit's `--precision bf16
--compile --fused-optimizer on`). Two passes of --steps steps: the first warms up (the CUDA
context, the allocator, compilation), the second is timed between device synchronisations.

Last line: RESULT {"samples_per_s" (both passes), "steady_samples_per_s" (the second),
"timed_s", "final_loss", ...}.
"""

import time

_T0 = time.perf_counter()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tasks"))
import common  # noqa: E402
import gpt_synth  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="steps per pass; 2 passes, the second timed")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--fast", action="store_true", help="bf16 autocast, torch.compile, fused AdamW")
    p.add_argument("--no-compile", action="store_true", help="--fast without torch.compile")
    for name, default in (
        ("n-layer", 12),
        ("n-head", 12),
        ("n-embd", 768),
        ("block-size", 1024),
        ("vocab-size", 50304),
    ):
        p.add_argument(f"--{name}", type=int, default=default)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    shape = (args.n_layer, args.n_head, args.n_embd, args.block_size, args.vocab_size)
    model = gpt_synth.make_model(*shape).to(device)
    data = gpt_synth.make_data(args.steps * args.batch_size, args.block_size, args.vocab_size)
    opt = gpt_synth.make_optimizer(model.parameters(), fused=args.fast)
    run = torch.compile(model) if args.fast and not args.no_compile else model
    half = torch.autocast(device.type, dtype=torch.bfloat16) if args.fast else contextlib.nullcontext()
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, pin_memory=device.type == "cuda")
    model.train()
    t_start, samples = time.perf_counter(), 0
    for epoch in range(2):
        if epoch == 1:
            sync(device)
            t_timed = time.perf_counter()
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with half:
                _, loss = run(**batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            samples += len(batch["idx"])
    sync(device)
    end = time.perf_counter()
    common.emit(
        _T0,
        world_size=1,
        threads=torch.get_num_threads(),
        workload="gpt-mfu",
        samples_per_s=samples / (end - t_start),
        steady_samples_per_s=len(data) / (end - t_timed),
        train_s=end - t_start,
        timed_s=end - t_timed,
        final_loss=loss.item(),
        fast=args.fast,
    )


if __name__ == "__main__":
    main()
