"""An own loop (2 processes, FSDP) that trains a few SGD steps, saves one file and a sharded folder
to the bucket URL given, and loads each back into a fresh model: a plain one (the file) and an
FSDP one (the shards). Rank 0 writes what it loaded beside OUT (OUT/whole.pt, OUT/sharded.pt) and
the trained weights (OUT/trained.pt) for the test to compare."""

import sys
from pathlib import Path

import torch

import ddpkit

url, out = sys.argv[1].rstrip("/"), Path(sys.argv[2])


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).double()


with ddpkit.init(device="cpu") as rt:
    model = rt.wrap(build(), strategy="fsdp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(rt.rank)
    for _ in range(3):
        x = torch.randn(4, 8, generator=g, dtype=torch.float64)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    rt.save(f"{url}/final.pt", model, opt, step=3)
    rt.save(f"{url}/final-sharded", model, opt, sharded=True, step=3)
    trained = {k: v.full_tensor() for k, v in model.state_dict().items()}

    plain = build()
    assert rt.load(f"{url}/final.pt", plain) == {"step": 3}
    again = rt.wrap(build(), strategy="fsdp")
    opt2 = torch.optim.SGD(again.parameters(), lr=0.1, momentum=0.9)
    assert rt.load(f"{url}/final-sharded", again, opt2) == {"step": 3}
    sharded = {k: v.full_tensor() for k, v in again.state_dict().items()}
    if rt.is_main:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(trained, out / "trained.pt")
        torch.save(plain.state_dict(), out / "whole.pt")
        torch.save(sharded, out / "sharded.pt")
