"""Run under `ddpkit launch --nproc 2`: the same FSDP training (the GPT example's AdamW with
decay groups, clipping) with the optimizer stepped on DTensors and on the local shards
(ddpkit's default), then the local one saved sharded and loaded into a fresh one. Rank 0
saves both final weights, what the state holds between steps and the reloaded state."""
import sys

import torch
from torch.distributed.tensor import DTensor

import ddpkit
from ddpkit.parallel.spec import StrategyConfig
from ddpkit.strategies.fsdp import FsdpStrategy
from ddpkit.strategies.local_step import step_on_local_shards
from ddpkit.strategies.optimizers import make_optimizer

sys.path.insert(0, sys.argv[2])  # examples/
from gpt import GPT, GPTConfig, adamw_with_decay_groups  # noqa: E402


def build():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8))


def train(rt, local):
    strategy = FsdpStrategy(rt.runtime, StrategyConfig(name="fsdp"))
    model = strategy.setup_module(build())
    factory = lambda ps: adamw_with_decay_groups(ps, lr=0.05)  # noqa: E731
    opt = strategy.setup_optimizer(factory, model) if local else make_optimizer(factory, model, None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))  # it wraps opt.step in turn
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        idx = torch.randint(0, 11, (4, 8), generator=gen)[rt.rank * 2 : rt.rank * 2 + 2]
        model(idx, targets=idx.roll(1, dims=1))[1].backward()
        strategy.clip_grad_norm(model, 0.1)
        opt.step()
        opt.zero_grad()
        scheduler.step()
    return strategy, model, opt


def main():
    out, tmp = sys.argv[1], sys.argv[3]
    with ddpkit.init(device="cpu") as rt:
        plain_strategy, plain, _ = train(rt, local=False)
        strategy, model, opt = train(rt, local=True)
        kinds = sorted({type(v).__name__ for s in opt.state.values() for v in s.values() if v.dim() > 0})
        params_between = all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"])
        rt.save(f"{tmp}/ckpt", model, opt, sharded=True)
        _, fresh, fresh_opt = train(rt, local=True)
        rt.load(f"{tmp}/ckpt", fresh, fresh_opt)
        result = {
            "dtensor_step": plain_strategy.full_state_dict(plain),
            "local_step": strategy.full_state_dict(model),
            "reloaded": strategy.full_state_dict(fresh),
            "state_kinds": kinds,
            "params_are_dtensors": params_between,
            "same_state": all(
                torch.equal(a.full_tensor(), b.full_tensor())
                for p, q in zip(model.parameters(), fresh.parameters(), strict=True)
                for a, b in zip(opt.state[p].values(), fresh_opt.state[q].values(), strict=True)
                if a.dim() > 0
            ),
            "steps": [float(s["step"]) for s in opt.state.values()],
            "wrapped": getattr(opt.step, "on_local_shards", False),
            "lbfgs_left_alone": not hasattr(
                step_on_local_shards(torch.optim.LBFGS(model.parameters())).step, "on_local_shards"
            ),
        }
        if rt.is_main:
            torch.save(result, out)


if __name__ == "__main__":
    main()
