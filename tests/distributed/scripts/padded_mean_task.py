"""The padded token task of token_task.py with the usual mistake: its step hook returns the
micro-batch's MEAN loss over its real tokens. Micro-batches hold different numbers of real
tokens, so a mean per micro-batch weights tokens differently at another world size or
accumulation: `ddpkit verify` must find the drift (token_task.py's `(loss_sum, count)` is exact)."""
from token_task import build as token_build
from torch.nn import functional as F


def mean_per_micro_batch(model, batch):
    out = model(batch["x"])
    per_token = F.cross_entropy(out["logits"].flatten(0, 1), batch["y"].flatten(), reduction="none")
    m = batch["mask"].flatten()
    return (per_token * m).sum() / m.sum()


def build(config=None):
    task = token_build(config)
    task.step = mean_per_micro_batch
    return task
