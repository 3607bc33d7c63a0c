"""A small GPT trained the way a widely used single-file training script does it, written for
ddpkit's tests: its own DDP set-up from torchrun's variables, gradient accumulation with DDP's
sync only on the last micro-step, AdamW with warmup and cosine decay, gradient clipping, its own
checkpoint (rank 0, every --ckpt_interval iterations and at the end) and its own resume
(--init_from=resume; a worker its launcher restarted resumes from the checkpoint too). Rank 0
logs every iteration's loss exactly (float.hex) to --loss_log. It never imports ddpkit.

Settings as --key=value: out_dir, loss_log, init_from (scratch | resume), max_iters, ckpt_interval,
die_at (rank 1 kills itself at this iteration on the first attempt), backend.
"""

import math
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

config = {
    "out_dir": "out",
    "loss_log": "losses.txt",
    "init_from": "scratch",
    "max_iters": 30,
    "ckpt_interval": 10,
    "die_at": -1,
    "backend": "gloo",
    "lr": 3e-3,
    "warmup": 5,
    "micro_steps": 2,
    "batch": 4,
    "block": 16,
}
for arg in sys.argv[1:]:
    key, _, value = arg.removeprefix("--").partition("=")
    if key not in config:
        sys.exit(f"unknown setting {key}")
    config[key] = type(config[key])(value)

TEXT = "".join(chr(97 + (i * 7 + (i // 13) * 3) % 26) for i in range(4000))  # a text with structure to learn
VOCAB = 26
data = torch.tensor([ord(c) - 97 for c in TEXT], dtype=torch.long)


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, width=32, heads=2, layers=2, block=16):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, width), nn.Embedding(block, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    dist.init_process_group(config["backend"])
rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
master = rank == 0
restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
ckpt_path = os.path.join(config["out_dir"], "ckpt.pt")


def batch(iteration, micro):
    """The same samples for an iteration, whenever it runs: seeded by iteration, micro-step and rank."""
    g = torch.Generator().manual_seed(100_003 * iteration + 101 * micro + rank)
    starts = torch.randint(len(data) - config["block"] - 1, (config["batch"],), generator=g)
    x = torch.stack([data[s : s + config["block"]] for s in starts])
    y = torch.stack([data[s + 1 : s + 1 + config["block"]] for s in starts])
    return x, y


def lr_at(iteration):
    if iteration < config["warmup"]:
        return config["lr"] * (iteration + 1) / config["warmup"]
    progress = (iteration - config["warmup"]) / max(1, config["max_iters"] - config["warmup"])
    return 0.1 * config["lr"] + 0.45 * config["lr"] * (1 + math.cos(math.pi * progress))


torch.manual_seed(1337)
model = TinyGPT(block=config["block"])
optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.1, betas=(0.9, 0.95))
iter_num = 0
if config["init_from"] == "resume" or (restarted and os.path.exists(ckpt_path)):
    checkpoint = torch.load(ckpt_path, map_location="cpu")
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    iter_num = checkpoint["iter_num"]
raw_model = model
if ddp:
    model = DDP(model)


def save(next_iter):
    os.makedirs(config["out_dir"], exist_ok=True)
    state = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": next_iter}
    torch.save(state, ckpt_path + ".tmp")
    os.replace(ckpt_path + ".tmp", ckpt_path)


while iter_num < config["max_iters"]:
    for group in optimizer.param_groups:
        group["lr"] = lr_at(iter_num)
    if ddp and rank == 1 and iter_num == config["die_at"] and not restarted:
        os.kill(os.getpid(), signal.SIGKILL)
    total = 0.0
    for micro in range(config["micro_steps"]):
        if ddp:
            model.require_backward_grad_sync = micro == config["micro_steps"] - 1
        x, y = batch(iter_num, micro)
        loss = model(x, y) / config["micro_steps"]
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if master:
        with open(config["loss_log"], "a") as f:
            f.write(f"iter {iter_num} loss {total.hex()}\n")
        print(f"iter {iter_num}: loss {total:.4f}", flush=True)
        if (iter_num + 1) % config["ckpt_interval"] == 0 or iter_num + 1 == config["max_iters"]:
            save(iter_num + 1)
    iter_num += 1

if ddp:
    dist.barrier()  # the checkpoint is written before any rank leaves
    dist.destroy_process_group()
