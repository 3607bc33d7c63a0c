"""A small GPT, trained on characters of text that ships with Python (no download).

    ddpkit train examples/gpt.py:build --nproc 2 --epochs 2 --batch-size 16 --accumulate 2 --clip-grad-norm 1.0
    ddpkit train examples/gpt.py:build --strategy fsdp --nproc 2 --epochs 2 --task-arg n_layer=4
    ddpkit train examples/gpt.py:build --task-arg n_embd=128 --task-arg block_size=128 --task-arg max_samples=None

What it shows, as a user would write it for nanoGPT-style training:
  * the model: token + position embedding, pre-LayerNorm blocks (causal self-attention
    through torch's scaled_dot_product_attention, a 4x MLP), a final LayerNorm and a head
    that shares the token embedding's weight. The blocks are an nn.ModuleList, so
    `--strategy fsdp` shards them one by one (ddpkit.strategies.fsdp.default_blocks).
    `forward(idx, targets=None)` returns `(logits, loss)`: ddpkit trains on that loss
    (the model's own, no loss_fn needed);
  * the data: the Python documentation's topics (`pydoc_data.topics`, ~465k characters),
    a vocabulary of its characters, cut into non-overlapping windows; every item is a dict
    `{"idx": LongTensor[T], "targets": the same window shifted by one}`, so the model is
    called as `model(idx=..., targets=...)`; the last 10% of the text is the eval split
    (its loss is the run's eval_loss);
  * AdamW with weight decay on the matrices only (dim >= 2; biases and LayerNorm weights
    get none), given as a function of the parameters so FSDP can build it over its shards;
  * linear warm-up then cosine decay to lr/10, a LambdaLR as Task.scheduler: ddpkit steps
    it once per optimizer step and keeps its state in every checkpoint;
  * `--clip-grad-norm 1.0` and `--accumulate 2` from the command line.

Every size is a task argument (`--task-arg KEY=VALUE`): n_layer, n_head, n_embd,
block_size, dropout, lr, weight_decay, warmup_steps, decay_steps, max_samples (training
windows kept; None: all), init (eager, or meta: built on the meta device, each rank
materialising only its part with `init_weights`; the same weights as eager), qkv (fused: one
Linear, as nanoGPT's c_attn; separate: q, k and v, which `--tp` splits by heads, by the task's
`tp_plan`), tie (False: the head has its own weight, which `--pp` needs):

    ddpkit train examples/gpt.py:build --nproc 4 --tp 2 --strategy fsdp --task-arg qkv=separate The defaults
are a 0.1M-parameter model that learns visibly in seconds: the first command above takes
~15 s on 2 CPU cores, and its eval loss falls from 4.6 (a uniform guess over the 103
characters) to ~2.9 after epoch 1 and ~2.8 after epoch 2.
With dropout 0 the run ends with the same model.pt at any world size (1 x 2B, 2 x B,
2 x B/2 with --accumulate 2); with dropout each rank draws its own masks.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

# ---------------------------------------------------------------------------- the model


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    qkv: str = "fused"  # fused: one Linear, as nanoGPT's c_attn; separate: q, k and v, which --tp splits by heads
    tie: bool = True  # the head shares the token embedding's weight (False: its own, which --pp needs)


def residual_std(cfg: GPTConfig) -> float:
    """GPT-2: the projections back into the residual stream start smaller, by depth."""
    return 0.02 / math.sqrt(2 * cfg.n_layer)


def init_weights(module: nn.Module) -> None:
    """GPT-2's init of one module: N(0, 0.02) matrices (the residual projections' smaller),
    zero biases. Applied to every module of an eager build, and given as Task.init_weights
    for a meta build (`--task-arg init=meta`), where ddpkit calls it on each module in turn
    with that module's tensors materialised: the same weights either way."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=getattr(module, "init_std", 0.02))
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be a multiple of n_head"
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        if cfg.qkv == "separate":
            self.q, self.k, self.v = (nn.Linear(cfg.n_embd, cfg.n_embd) for _ in range(3))
        else:
            self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.proj.init_std = residual_std(cfg)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        if hasattr(self, "qkv"):  # (B, T, 3C) -> three (B, heads, T, C / heads)
            q, k, v = self.qkv(x).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        else:  # heads viewed from the tensor: under --tp each rank's q, k, v hold its share of the heads
            q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, -1)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.proj.init_std = residual_std(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.up(x))))


class Block(nn.Module):
    """Pre-LN: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))  # one FSDP unit each
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie:
            self.head.weight = self.wte.weight  # weight tying: one matrix embeds and predicts
        self.apply(init_weights)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = idx.shape[1]
        # torch._assert, not an `if`: torch.fx traces it (--pp cuts the traced forward into stages)
        torch._assert(t <= self.cfg.block_size, f"a sequence longer than block_size {self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:  # mean over every token of the micro-batch
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 1.0) -> torch.Tensor:
        for _ in range(new_tokens):
            logits, _ = self(idx[:, -self.cfg.block_size :])
            probs = F.softmax(logits[:, -1, :] / temperature, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1)], dim=1)
        return idx


def tp_plan(qkv: str = "fused") -> dict[str, str]:
    """--tp N: the attention's q, k, v and the MLP's up split by columns (each rank computes its
    share of the heads and of the hidden features), the projections after them by rows (their
    partial outputs summed); embeddings, norms and the head stay whole on every rank. A fused qkv
    is named as it is, and refused: a column split of it would cut across q, k and v."""
    attention = {"blocks.*.attn.qkv": "colwise"} if qkv == "fused" else {f"blocks.*.attn.{p}": "colwise" for p in "qkv"}
    return {
        **attention,
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp.up": "colwise",
        "blocks.*.mlp.proj": "rowwise",
        "blocks.*.ln_1": "sequence_parallel",
        "blocks.*.ln_2": "sequence_parallel",
    }


# ---------------------------------------------------------------------------- the data


def python_docs_text() -> str:
    """The text of Python's documentation topics (the `help('topics')` pages), in a fixed order."""
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics))


class CharVocab:
    """One id per character of the text."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


class CharWindows(Dataset):
    """Non-overlapping windows of `block_size` characters: item i is
    {"idx": ids[i*T : (i+1)*T], "targets": ids[i*T+1 : (i+1)*T+1]}."""

    def __init__(self, ids: torch.Tensor, block_size: int, max_samples: int | None = None) -> None:
        n = (len(ids) - 1) // block_size
        if max_samples is not None:
            n = min(n, max_samples)
        self.x = ids[: n * block_size].view(n, block_size)
        self.y = ids[1 : n * block_size + 1].view(n, block_size)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"idx": self.x[i], "targets": self.y[i]}


def char_data(block_size: int, max_samples: int | None = None, val_fraction: float = 0.1):
    """(train windows, eval windows, vocabulary) of the Python docs text. Eval keeps at most
    max_samples // 4 windows (at least 8), so a small run evaluates quickly too."""
    text = python_docs_text()
    vocab = CharVocab(text)
    ids = vocab.encode(text)
    split = int(len(ids) * (1 - val_fraction))
    eval_max = None if max_samples is None else max(8, max_samples // 4)
    return CharWindows(ids[:split], block_size, max_samples), CharWindows(ids[split:], block_size, eval_max), vocab


# ---------------------------------------------------------------------------- optimizer and schedule


def adamw_with_decay_groups(params, lr: float, weight_decay: float = 0.1, betas=(0.9, 0.95)) -> torch.optim.AdamW:
    """AdamW that decays the matrices (embeddings, linear weights: dim >= 2) and not the
    biases and LayerNorm weights. `params` may be FSDP's shards: they keep the full dim."""
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas)


def warmup_cosine(warmup_steps: int, decay_steps: int, min_ratio: float = 0.1):
    """The factor of the base lr at optimizer step s: linear from 1/warmup to 1 over the
    warm-up, then a cosine from 1 to min_ratio at `decay_steps`, min_ratio after."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if step >= decay_steps:
            return min_ratio
        progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def run_steps(config, n_train: int) -> int | None:
    """The optimizer steps this run will take (None without a RunConfig): --max-steps (which
    overrides --epochs), or epochs x steps per epoch at the job's global batch (batch x
    accumulate x world size), as ddpkit counts them."""
    if config is None:
        return None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
    else:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    world //= getattr(config, "tp", 1) * getattr(config, "pp", 1)  # the ranks of a tp group or pipeline share samples
    if getattr(config, "max_steps", None):
        return config.max_steps
    if not isinstance(config.batch_size, int):  # --batch-size auto: chosen after the task is built
        raise ValueError("--batch-size auto: give --max-steps (the cosine schedule's length needs the batch)")
    per_epoch = math.ceil(n_train / (config.batch_size * getattr(config, "accumulate", 1) * world))
    return config.epochs * per_epoch


# ---------------------------------------------------------------------------- the task


def build(
    config=None,
    *,
    n_layer: int = 2,
    n_head: int = 4,
    n_embd: int = 64,
    block_size: int = 64,
    dropout: float = 0.0,
    lr: float = 3e-3,
    weight_decay: float = 0.1,
    warmup_steps: int = 10,
    decay_steps: int | None = None,
    max_samples: int | None = 2048,
    init: str = "eager",
    qkv: str = "fused",
    tie: bool = True,
):
    """The ddpkit task. `decay_steps` (default: the run's optimizer steps, from the
    RunConfig) is where the cosine reaches lr/10. `init=meta` builds the model on the meta
    device (no memory): each rank then materialises only its part (--strategy fsdp: its
    shards), initialised by `init_weights`, equal to the eager build under the same seed."""
    import ddpkit  # here, so that the benchmark's hand-written loop imports this file without ddpkit

    if init not in ("eager", "meta"):
        raise ddpkit.DdpkitError(f"--task-arg init={init}: use eager or meta")
    if qkv not in ("fused", "separate"):
        raise ddpkit.DdpkitError(f"--task-arg qkv={qkv}: use fused or separate")
    train_set, eval_set, vocab = char_data(block_size, max_samples)
    with torch.device("meta" if init == "meta" else "cpu"):
        model = GPT(GPTConfig(len(vocab), block_size, n_layer, n_head, n_embd, dropout, qkv, tie))
    decay_steps = decay_steps or run_steps(config, len(train_set)) or 1000
    schedule = warmup_cosine(warmup_steps, decay_steps)
    return ddpkit.Task(
        model=model,
        train_set=train_set,
        eval_set=eval_set,
        optimizer=lambda params: adamw_with_decay_groups(params, lr=lr, weight_decay=weight_decay),
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
        init_weights=init_weights if init == "meta" else None,
        tp_plan=tp_plan(qkv),
    )


if __name__ == "__main__":  # a quick look without ddpkit's launcher: one process, a few steps
    torch.manual_seed(0)
    task = build(None)
    opt = task.optimizer(task.model.parameters())
    sched = task.scheduler(opt)
    loader = torch.utils.data.DataLoader(task.train_set, batch_size=32, shuffle=True)
    for step, batch in zip(range(60), loader, strict=False):  # at most 60 steps, fewer if the loader ends first
        _, loss = task.model(**batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(task.model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.3f}  lr {sched.get_last_lr()[0]:.2e}")
    vocab = char_data(task.model.cfg.block_size, 8)[2]
    print(vocab.decode(task.model.generate(vocab.encode("The ")[None], 80)[0]))
