"""Each rank's peak memory while a model of 2.1 GB (fp32, built on the meta device) is set up
under FSDP: `ddpkit launch --nproc 4 meta_setup_memory.py OUT_DIR` writes
OUT_DIR/rank-R.json with the bytes above the resident set before setup, the model's size and
its largest block. The peak is the kernel's high-water mark (VmHWM), reset just before setup."""

import json
import sys
from pathlib import Path

import torch
from torch import nn

import ddpkit

WIDTH, DEPTH = 4096, 4  # each block: 4096 x 16384 twice, 134M parameters (537 MB); 2.15 GB in all


class Linear(nn.Linear):
    def reset_parameters(self) -> None:  # a constant: drawing 2 GB of random numbers per rank is slow on CPUs
        nn.init.constant_(self.weight, 0.01)


class Drawn(nn.Linear):
    """One random constant: the ranks' shards are of the same draw, or the whole is not constant."""

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, float(torch.rand(1, device="cpu")))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = Linear(WIDTH, 4 * WIDTH, bias=False)
        self.down = Linear(4 * WIDTH, WIDTH, bias=False)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.drawn = Drawn(64, 64, bias=False)


def status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def main() -> None:
    out = Path(sys.argv[1])
    with ddpkit.init(threads=1) as rt:
        torch.manual_seed(rt.rank)  # an own loop's ranks need not share a seed: ddpkit shares rank 0's draw
        with torch.device("meta"):
            model = Model()
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        block = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
        rt.barrier()
        Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from here
        before = status("VmRSS")
        model = rt.wrap(model, strategy="fsdp")
        peak = status("VmHWM") - before
        drawn = model.drawn.weight.full_tensor()
        same_draw = bool((drawn == drawn[0, 0]).all())
        local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        ok = all(bool((p.to_local() == 0.01).all()) for p in model.blocks.parameters())
        rt.barrier()
        (out / f"rank-{rt.rank}.json").write_text(
            json.dumps(
                {"peak": peak, "model": size, "block": block, "local": local, "initialised": ok, "same_draw": same_draw}
            )
        )


if __name__ == "__main__":
    main()
