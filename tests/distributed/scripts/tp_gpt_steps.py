"""Five SGD steps of the two-block GPT of test_tensor_parallel_plan.py, float64, its Linears split
over a tp mesh of every rank (strategies/tensor_parallel.apply_plan), each rank fed the same batch;
rank 0 writes the whole weights (full_tensor) to argv[1]. At one process: no split at all."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "strategies"))
from test_tensor_parallel_plan import PLAN, Gpt  # noqa: E402

from ddpkit.strategies.tensor_parallel import apply_plan, check_plan, resolve_plan  # noqa: E402


def train(world: int) -> tuple[dict, torch.Tensor]:
    """The whole weights and the last loss after the steps. Returning lets the split model, its
    mesh and the optimizer go before the process group is torn down (torch 2.13 aborts at exit
    now and then when a group is destroyed under objects still holding it: runtime/group.py)."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    model = Gpt()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        resolved = resolve_plan(model, PLAN)
        check_plan(model, resolved, world)
        apply_plan(model, resolved, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(5, 4, 6, 32, generator=torch.Generator().manual_seed(1))
    for x in data:
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    whole = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in model.state_dict().items()}
    return whole, loss.detach()


def main(out: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    whole, loss = train(world)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({"weights": whole, "loss": loss}, out)
    if world > 1:
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
