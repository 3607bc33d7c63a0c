"""Run under `ddpkit launch --nproc 2`: the same float64 SGD steps of a small GPT (dropout on,
so the recomputation must draw the masks the forward drew) under DDP and FSDP, each with and
without activation checkpointing; then checkpoints cross: one saved with checkpointing loads
into a model without, and back, whole (DDP) and sharded (FSDP). Rank 0 saves what it saw."""
import sys

import torch

import ddpkit
from ddpkit.strategies.activation import is_checkpointed

sys.path.insert(0, sys.argv[2])  # examples/
from gpt import GPT, GPTConfig  # noqa: E402


def build():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=3, n_head=2, n_embd=8, dropout=0.2)).double()


def train(rt, strategy, checkpointing, steps=3):
    model, opt = rt.wrap(
        build(), lambda ps: torch.optim.SGD(ps, lr=0.5), strategy=strategy, activation_checkpointing=checkpointing
    )
    torch.manual_seed(100 + rt.rank)  # each rank its own dropout masks, the same in every variant
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        idx = torch.randint(0, 11, (4, 8), generator=gen)  # the global batch; 2 windows per rank
        mine = slice(rt.rank * 2, rt.rank * 2 + 2)
        model(idx[mine], targets=idx[mine].roll(1, dims=1))[1].backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def main():
    out, tmp = sys.argv[1], sys.argv[3]
    result = {"state": {}, "checkpointed": {}}
    with ddpkit.init(device="cpu") as rt:
        assert rt.world_size == 2, rt.world_size
        for strategy in ("ddp", "fsdp"):
            for checkpointing in (False, True):
                model, opt = train(rt, strategy, checkpointing)
                inner = getattr(model, "module", model)
                result["checkpointed"][strategy, checkpointing] = [
                    name for name, m in inner.named_modules() if is_checkpointed(m)
                ]
                result["state"][strategy, checkpointing] = rt.strategy.full_state_dict(model)
                sharded = strategy == "fsdp"
                rt.save(f"{tmp}/{strategy}-{checkpointing}", model, opt, sharded=sharded)
                del model, opt
                rt.strategy = None  # the next variant wraps anew
        # each checkpoint into a model with the other setting: the same weights come back
        result["crossed"] = {}
        for strategy in ("ddp", "fsdp"):
            for checkpointing in (False, True):
                model, opt = rt.wrap(
                    build(), lambda ps: torch.optim.SGD(ps, lr=0.5), strategy=strategy,
                    activation_checkpointing=not checkpointing,
                )
                rt.load(f"{tmp}/{strategy}-{checkpointing}", model, opt)
                result["crossed"][strategy, checkpointing] = rt.strategy.full_state_dict(model)
                del model, opt
                rt.strategy = None
        if rt.is_main:
            result["init"] = build().state_dict()
            torch.save(result, out)


if __name__ == "__main__":
    main()
