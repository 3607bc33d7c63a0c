"""A Hugging Face model, trained as it comes: a tiny `transformers.GPT2LMHeadModel` built
from a GPT2Config (random weights, nothing downloaded), on padded batches of varying length.

    pip install 'ddpkit[hf]'      # transformers
    ddpkit train examples/hf_transformers.py:build --nproc 2 --epochs 2 --batch-size 16
    ddpkit train examples/hf_transformers.py:build_exact --nproc 2 --epochs 2 --batch-size 16
    ddpkit train examples/hf_transformers.py:build --strategy fsdp --nproc 2 --task-arg n_layer=4

`build`: no wrapper, no loss function. Every item is a dict {"input_ids", "attention_mask",
"labels"}, so ddpkit calls `model(input_ids=..., attention_mask=..., labels=...)` and
trains on the output's own `.loss` (HF's mean over the micro-batch's label tokens). The
items are paragraphs of the Python documentation (`pydoc_data.topics`, shipped with
Python) as characters, cut to at most `max_length` and right-padded to it: labels are
-100 on the padding, which the loss ignores. The transformer's blocks
(`model.transformer.h`, an nn.ModuleList) are FSDP's units under `--strategy fsdp`.

Padding makes the plain path depend on the world size: each micro-batch's loss is a mean
over ITS tokens, and ddpkit weights it by its number of samples, so 2 processes x 8
paragraphs and 1 process x 16 weigh the tokens slightly differently. `build_exact` adds
`Task.step`, which returns (the sum of the token losses, the number of label tokens):
ddpkit then divides by the token count over all micro-batches and ranks, so the step is
the mean over every label token of the global batch, as on one process, and the final
model.pt is the same at any world size and --accumulate (with dropout 0).

The trained model leaves as a folder `from_pretrained` loads (docs/export.md):

    ddpkit export RUN_DIR --format hf --out gpt2-hf      # or `--export hf` on ddpkit train
    AutoModelForCausalLM.from_pretrained("gpt2-hf")

(its config is kept in RUN_DIR/hf_config/ when the run starts; the tied lm_head is written
once, as save_pretrained writes it).

Task arguments (--task-arg KEY=VALUE): n_layer, n_head, n_embd, max_length, dropout, lr,
max_samples (training pieces kept; None: all 7,378); pretrained=FOLDER fine-tunes the model
saved there (save_pretrained), init=meta builds it on the meta device and lets each rank read
only its shards of the weights (`--strategy fsdp`). The first command above takes ~30 s
on 2 CPU cores (most of it transformers' import and its slower forward); its eval loss
falls from 4.6 to ~2.9.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from torch.utils.data import Dataset

import ddpkit

PAD = 0  # token id of the padding (its labels are IGNORE, so its value never matters)
IGNORE = -100  # the label HF's loss (and F.cross_entropy's default) leaves out


def python_doc_paragraphs(min_chars: int = 16) -> list[str]:
    """The paragraphs (blank-line separated) of Python's documentation topics, in a fixed order."""
    from pydoc_data.topics import topics

    paragraphs = []
    for key in sorted(topics):
        paragraphs += [p.strip() for p in topics[key].split("\n\n")]
    return [p for p in paragraphs if len(p) >= min_chars]


class PaddedParagraphs(Dataset):
    """Paragraphs as character ids (1..V; 0 is the padding), cut into pieces of at most
    `max_length` characters (the last piece of a long paragraph is shorter) and padded on
    the right to `max_length`. Item i: {"input_ids", "attention_mask", "labels"}, each a
    LongTensor[max_length]; labels are the ids where attended and IGNORE on the padding."""

    def __init__(
        self, paragraphs: list[str], chars: list[str], max_length: int, max_samples: int | None = None
    ) -> None:
        index = {c: i + 1 for i, c in enumerate(chars)}
        pieces = [p[i : i + max_length] for p in paragraphs for i in range(0, len(p), max_length)]
        pieces = [p for p in pieces if len(p) >= 2][:max_samples]  # a 1-character piece predicts nothing
        self.input_ids = torch.full((len(pieces), max_length), PAD, dtype=torch.long)
        self.attention_mask = torch.zeros((len(pieces), max_length), dtype=torch.long)
        for row, piece in enumerate(pieces):
            self.input_ids[row, : len(piece)] = torch.tensor([index[c] for c in piece])
            self.attention_mask[row, : len(piece)] = 1
        self.labels = self.input_ids.masked_fill(self.attention_mask == 0, IGNORE)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "attention_mask": self.attention_mask[i], "labels": self.labels[i]}


def doc_data(max_length: int, max_samples: int | None = None, eval_fraction: float = 0.1):
    """(train set, eval set, characters): the last 10% of the paragraphs are held out; the
    eval set keeps at most max_samples // 4 pieces (at least 8)."""
    paragraphs = python_doc_paragraphs()
    chars = sorted(set("".join(paragraphs)))
    split = int(len(paragraphs) * (1 - eval_fraction))
    eval_max = None if max_samples is None else max(8, max_samples // 4)
    return (
        PaddedParagraphs(paragraphs[:split], chars, max_length, max_samples),
        PaddedParagraphs(paragraphs[split:], chars, max_length, eval_max),
        chars,
    )


def gpt2_model(
    vocab_size: int, max_length: int, n_layer: int = 2, n_head: int = 4, n_embd: int = 64, dropout: float = 0.0
):
    """A randomly initialised GPT-2 of the given size (transformers' own code, no weights fetched)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=max_length,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=PAD,
        eos_token_id=PAD,
        pad_token_id=PAD,
    )
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # HF's own causal-LM loss, named (transformers 5 warns when it has to guess)
    return model


def pretrained_gpt2(folder: str, init: str = "eager"):
    """The GPT-2 saved in `folder`: whole from its weights (eager), or on the meta device from
    its config alone (meta: no memory; the weights come from Task.init_from)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if init not in ("eager", "meta"):
        raise ddpkit.DdpkitError(f"--task-arg init={init}: use eager or meta")
    if init == "eager":
        model = GPT2LMHeadModel.from_pretrained(folder)
    else:
        with torch.device("meta"):
            model = GPT2LMHeadModel(GPT2Config.from_pretrained(folder))
    model.loss_type = "ForCausalLM"
    return model


def token_loss_sum(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Task.step: (sum of the next-token losses, number of label tokens) of a micro-batch,
    the same shift HF's own loss makes (position t predicts label t + 1)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    loss_sum = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    return loss_sum, (labels != IGNORE).sum()


def build(
    config=None,
    *,
    n_layer: int = 2,
    n_head: int = 4,
    n_embd: int = 64,
    max_length: int = 64,
    dropout: float = 0.0,
    lr: float = 3e-3,
    max_samples: int | None = 2048,
    exact: bool = False,
    pretrained: str | None = None,
    init: str = "eager",
) -> ddpkit.Task:
    """The model's own loss (`exact=True`: the token-exact Task.step, as build_exact).
    `pretrained`: fine-tune the model saved in that folder (save_pretrained) instead, its size
    from the folder's config: loaded whole by `from_pretrained`, or with `init=meta` built on
    the meta device and filled by ddpkit (Task.init_from), each rank reading only its shards."""
    train_set, eval_set, chars = doc_data(max_length, max_samples)
    if pretrained is not None:
        model = pretrained_gpt2(pretrained, init)
    else:
        model = gpt2_model(len(chars) + 1, max_length, n_layer, n_head, n_embd, dropout)
    return ddpkit.Task(
        init_from=pretrained if init == "meta" else None,
        model=model,
        train_set=train_set,
        eval_set=eval_set,
        optimizer=lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01),
        step=token_loss_sum if exact else None,
    )


def build_exact(
    config=None,
    *,
    n_layer: int = 2,
    n_head: int = 4,
    n_embd: int = 64,
    max_length: int = 64,
    dropout: float = 0.0,
    lr: float = 3e-3,
    max_samples: int | None = 2048,
    pretrained: str | None = None,
    init: str = "eager",
) -> ddpkit.Task:
    """`build` with Task.step = token_loss_sum: the mean over every label token of the global batch."""
    return build(
        config,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        max_length=max_length,
        dropout=dropout,
        lr=lr,
        max_samples=max_samples,
        exact=True,
        pretrained=pretrained,
        init=init,
    )


if __name__ == "__main__":  # a quick look without ddpkit's launcher: one process, a few steps
    torch.manual_seed(0)
    train_set, _, chars = doc_data(64, 512)
    model = gpt2_model(len(chars) + 1, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(train_set, batch_size=16, shuffle=True)
    for step, batch in enumerate(loader):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 8 == 0:
            print(
                f"step {step:3d}  loss {loss.item():.3f}  "
                f"exact {(lambda s, n: s / n)(*token_loss_sum(model, batch)).item():.3f}"
            )
