"""A token-level task with dict items of varying length (padding masked out), the shape of
a tokenised language-model data set, small enough for CPU tests.

    items: {"x": LongTensor[T], "y": LongTensor[T], "mask": BoolTensor[T]}
    model(x, y=None, mask=None) -> {"logits": ..., "loss": mean over real tokens (None without y)}

With use_step=True the task's step hook returns (token loss sum, token count), so ddpkit
normalises by the global token count and 1 or N processes, with or without accumulation,
train the same model. With use_step=False ddpkit takes the model's own .loss."""
import torch
from torch import nn
from torch.nn import functional as F

import ddpkit


class TinyTokenModel(nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, x, y=None, mask=None):
        logits = self.head(torch.tanh(self.mix(self.embed(x))))
        loss = None
        if y is not None:
            per_token = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
            m = mask.flatten().float()
            loss = (per_token * m).sum() / m.sum().clamp(min=1)
        return {"logits": logits, "loss": loss}


def token_step(model, batch):
    out = model(batch["x"])
    per_token = F.cross_entropy(out["logits"].flatten(0, 1), batch["y"].flatten(), reduction="none")
    m = batch["mask"].flatten()
    return (per_token * m).sum(), m.sum()


class Items(torch.utils.data.Dataset):
    def __init__(self, x, y, mask):
        self.x, self.y, self.mask = x, y, mask

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "mask": self.mask[i]}


def build(config=None, vocab: int = 13, seq: int = 10, samples: int = 96, width: int = 16, use_step: bool = True,
          schedule: bool = False, lr: float = 0.05):
    g = torch.Generator().manual_seed(7)  # the same data on every rank
    x = torch.randint(0, vocab, (samples, seq), generator=g)
    y = (x * 3 + 1) % vocab
    lengths = torch.randint(2, seq + 1, (samples,), generator=g)  # 2..seq real tokens, the rest padding
    mask = torch.arange(seq)[None, :] < lengths[:, None]
    split = samples * 3 // 4
    return ddpkit.Task(
        model=TinyTokenModel(vocab, width),
        train_set=Items(x[:split], y[:split], mask[:split]),
        eval_set=Items(x[split:], y[split:], mask[split:]),
        optimizer=lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01),
        step=token_step if use_step else None,
        scheduler=(lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)) if schedule == 1 else
        (lambda opt, total: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / total)) if schedule == 2 else None,
    )


def namespace_output(config=None):
    """The model returns its tensors inside a SimpleNamespace: FSDP's pytree cannot see them."""
    from types import SimpleNamespace

    task = build(config, use_step=False)
    forward = task.model.forward
    task.model.forward = lambda *a, **k: SimpleNamespace(**forward(*a, **k))
    return task


def not_a_scheduler(config=None):
    task = build(config)
    task.scheduler = lambda opt: "linear"
    return task
