"""Run under `ddpkit launch --nproc 4`: the same float64 SGD steps (with clipping) under DDP
and under FSDP over a (2, 2) device mesh (HSDP: 2 replicas of 2 shards). Rank 0 saves both
final weights, the norms clipping saw, and what the HSDP parameters are laid out over."""
import sys

import torch
from torch import nn

import ddpkit
from ddpkit.parallel.spec import StrategyConfig
from ddpkit.strategies import DdpStrategy
from ddpkit.strategies.fsdp import FsdpStrategy


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def train(rt, strategy, steps=4):
    model = strategy.setup_module(build())
    opt = strategy.setup_optimizer(lambda ps: torch.optim.SGD(ps, lr=0.5), model)
    gen = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(steps):
        x = torch.randn(32, 6, generator=gen, dtype=torch.float64)  # the global batch, the same on every rank
        y = torch.randint(0, 3, (32,), generator=gen)
        mine = slice(rt.rank * 8, (rt.rank + 1) * 8)  # 8 samples per rank; gradients are averaged over 4
        nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
        norms.append(strategy.clip_grad_norm(model, 0.05))  # below the norm: clipping changes the step
        opt.step()
        opt.zero_grad()
    return strategy.full_state_dict(model), norms, model


def main():
    out = sys.argv[1]
    with ddpkit.init(device="cpu") as rt:
        assert rt.world_size == 4, rt.world_size
        ddp_state, ddp_norms, _ = train(rt, DdpStrategy(rt.runtime))
        hsdp = FsdpStrategy(rt.runtime, StrategyConfig(name="fsdp"), mesh_shape=(2, 2))
        hsdp_state, hsdp_norms, model = train(rt, hsdp)
        weight = model[0].weight
        layout = {"mesh": tuple(weight.device_mesh.shape), "names": weight.device_mesh.mesh_dim_names,
                  "placements": [type(p).__name__ for p in weight.placements], "local_rows": weight.to_local().shape[0]}
        if rt.is_main:
            torch.save({"ddp": ddp_state, "hsdp": hsdp_state, "ddp_norms": ddp_norms, "hsdp_norms": hsdp_norms,
                        "layout": layout, "init": build().state_dict()}, out)


if __name__ == "__main__":
    main()
