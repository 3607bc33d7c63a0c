"""A nanoGPT-shaped float64 task for the pipeline tests: token + position embedding, pre-LN
blocks with separate q/k/v projections (an nn.ModuleList), a final LayerNorm and an untied
head; (tokens, next tokens) items scored by a cross-entropy loss_fn. `model=` picks a model
that cannot be cut (the refusals): `tied` (head shares the embedding), `branchy` (a Python
branch on a tensor value), `flat` (no blocks)."""

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit

VOCAB, T, D = 16, 8, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.proj = (nn.Linear(D, D) for _ in range(4))
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        b, t, c = x.shape
        y = self.ln_1(x)
        q, k, v = (m(y).view(b, t, 2, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(a)
        return x + self.down(F.gelu(self.up(self.ln_2(x))))


class TinyGPT(nn.Module):
    def __init__(self, layers: int = 4, tied: bool = False) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Branchy(TinyGPT):
    def forward(self, idx):
        if idx.sum() > 0:  # a branch on a tensor's value: no graph to cut
            idx = idx - 0
        return super().forward(idx)


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def build(config=None, model: str = "gpt", layers: int = 4, samples: int = 48, held: int = 15, optimizer: str = "sgd"):
    torch.manual_seed(3)
    net = {
        "gpt": lambda: TinyGPT(layers),
        "tied": lambda: TinyGPT(layers, tied=True),
        "branchy": lambda: Branchy(layers),
        "flat": lambda: nn.Linear(T, VOCAB),
    }[model]().double()
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (samples + held, T + 1), generator=g)
    train, held = tokens[:samples], tokens[samples:]
    make = {  # momentum: optimizer state that a resume at another mesh must carry over by name
        "sgd": lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9),
        "adamw": lambda params: torch.optim.AdamW(params, lr=0.01),
    }[optimizer]
    return ddpkit.Task(
        model=net,
        train_set=TensorDataset(train[:, :-1], train[:, 1:]),
        eval_set=TensorDataset(held[:, :-1], held[:, 1:]),
        loss_fn=loss_fn,
        optimizer=make,
    )
