"""A GPT ready for --tp and --pp: what examples/gpt.py is, with what the splits need.

    ddpkit train examples/tp_gpt.py:build --nproc 4 --tp 2 --strategy fsdp --batch-size 8 --max-steps 20
    ddpkit train examples/tp_gpt.py:build --nproc 4 --pp 2 --save-every 0 --batch-size 8 --max-steps 20
    ddpkit plan examples/tp_gpt.py:build --nnodes 128 --nproc 8 --tp 8 --pp 4 --strategy fsdp --batch-size 8 \
        --task-arg n_layer=32 --task-arg n_embd=4096 --task-arg n_head=32 --task-arg block_size=2048 \
        --task-arg vocab=50304 --task-arg init=meta

What differs from examples/gpt.py, and why:
  * q, k and v are three Linears (a column split of one fused q/k/v Linear would cut across
    them, not between heads), and the attention views its heads from the tensor
    (`view(B, T, -1, head_dim)`), so each tp rank runs its own heads with nothing to change;
  * the head does not share the embedding's weight (a weight on two pipeline stages would be
    two copies trained apart);
  * items are (tokens, next tokens) scored by `loss_fn` (the last stage of a pipeline scores
    the targets; dict batches do not run through stages);
  * `TP_PLAN` names the split: q, k, v and the MLP's up projection column-wise, the
    attention's output and the MLP's down projection row-wise, the norms whole.

The tokens are random (a fixed seed), so sizes can be anything: the plan of a 7B-parameter
model builds it on the meta device (`--task-arg init=meta`) in a second.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

TP_PLAN = {
    "blocks.*.attn.q": "colwise",
    "blocks.*.attn.k": "colwise",
    "blocks.*.attn.v": "colwise",
    "blocks.*.attn.o": "rowwise",
    "blocks.*.mlp.up": "colwise",
    "blocks.*.mlp.down": "rowwise",
    "blocks.*.ln_1": "sequence_parallel",
    "blocks.*.ln_2": "sequence_parallel",
}


class Attention(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.head_dim = d // n_head
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Mlp(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(d), Attention(d, n_head), nn.LayerNorm(d), Mlp(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TpGPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, n_layer: int, n_head: int, n_embd: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f, self.head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def init_weights(module: nn.Module) -> None:
    """N(0, 0.02) matrices, zero biases (a meta build gets the same, module by module)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def build(
    config=None,
    *,
    vocab: int = 256,
    block_size: int = 64,
    n_layer: int = 4,
    n_head: int = 4,
    n_embd: int = 64,
    samples: int = 512,
    lr: float = 1e-3,
    dtype: str = "float32",
    init: str = "eager",
):
    """The task (every size a --task-arg). `init=meta`: built on the meta device, each rank
    materialising its part with `init_weights`. `dtype=float64` for exactness checks."""
    import ddpkit

    if init not in ("eager", "meta"):
        raise ddpkit.DdpkitError(f"--task-arg init={init}: use eager or meta")
    torch.manual_seed(0)
    with torch.device("meta" if init == "meta" else "cpu"):
        model = TpGPT(vocab, block_size, n_layer, n_head, n_embd).to(getattr(torch, dtype))
    if init == "eager":
        model.apply(init_weights)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (samples + 32, block_size + 1), generator=g)
    train, held = tokens[:samples], tokens[samples:]
    return ddpkit.Task(
        model=model,
        train_set=TensorDataset(train[:, :-1], train[:, 1:]),
        eval_set=TensorDataset(held[:, :-1], held[:, 1:]),
        loss_fn=loss_fn,
        optimizer=lambda params: torch.optim.AdamW(params, lr=lr),
        init_weights=init_weights if init == "meta" else None,
        tp_plan=TP_PLAN,
        tokens_per_sample=block_size,
    )
