"""A ddpkit task of a tiny transformers Llama built from a config (random weights, nothing
downloaded), float64, SGD, and no tp_plan of its own: under `--tp` ddpkit splits it by the
model's own plan (its `_tp_plan`: the config's base_model_tp_plan under `model.`, the embedding
rowwise, the head colwise with its logits gathered)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from ddpkit import Task

VOCAB, LENGTH = 64, 8


class Windows(Dataset):
    """Random token windows, every token a label (no padding: each micro-batch's mean is over the
    same number of tokens, so the sample-weighted mean is the global batch's)."""

    def __init__(self, n: int, seed: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build(samples: int = 16, tie: bool = False) -> Task:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention: 2 q heads per kv head, on every tp rank too
        max_position_embeddings=LENGTH,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double()
    model.loss_type = "ForCausalLM"
    return Task(
        model=model,
        train_set=Windows(samples, 1),
        eval_set=Windows(10, 2),  # 10 samples: 2 dp ranks must count each once
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
    )
