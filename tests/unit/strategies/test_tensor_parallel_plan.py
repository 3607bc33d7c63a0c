"""The tensor-parallel plan (strategies/tensor_parallel.py): resolved against the model's module
names and refused in one line before anything trains; a transformers Llama's own plan used."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpkit.errors import DdpkitError
from ddpkit.strategies.tensor_parallel import check_plan, plan_of, resolve_plan

PLAN = {
    "blocks.*.attn.q": "colwise",
    "blocks.*.attn.k": "colwise",
    "blocks.*.attn.v": "colwise",
    "blocks.*.attn.o": "rowwise",
    "blocks.*.up": "colwise",
    "blocks.*.down": "rowwise",
    "blocks.*.norm": "sequence_parallel",
}


class Attention(nn.Module):
    """A TP-ready attention: separate q/k/v, heads viewed from the tensor (-1), a fixed head_dim."""

    def __init__(self, d: int, n_head: int, fused: bool = False) -> None:
        super().__init__()
        self.head_dim = d // n_head
        if fused:
            self.qkv = nn.Linear(d, 3 * d)
        else:
            self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, fused: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = Attention(d, n_head, fused)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.down(torch.relu(self.up(x)))


class Gpt(nn.Module):
    def __init__(self, d: int = 32, n_head: int = 4, layers: int = 2, fused: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, n_head, fused) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_plan_resolves_to_each_module_it_names():
    resolved = resolve_plan(Gpt(), PLAN)
    assert resolved["blocks.1.attn.q"] == "colwise" and resolved["blocks.0.down"] == "rowwise"
    assert len(resolved) == 14
    check_plan(Gpt(), resolved, 2)


@pytest.mark.parametrize(
    ("model", "plan", "tp", "said"),
    [
        (Gpt(), {**PLAN, "blocks.*.mlp.fc": "colwise"}, 2, "'blocks.*.mlp.fc' matches no module"),
        (Gpt(), {"blocks.*.attn.q": "local_packed_rowwise"}, 2, "style 'local_packed_rowwise' is not one"),
        (Gpt(fused=True), {"blocks.*.attn.qkv": "colwise"}, 2, "q/k/v fused into one Linear cannot be column-split"),
        (Gpt(), PLAN, 3, "--tp 3: blocks.0.attn.q's 32 output features do not divide by 3"),
        (Gpt(), {"blocks.*.norm": "colwise"}, 2, "blocks.0.norm is a LayerNorm, not a Linear"),
    ],
)
def test_a_plan_that_cannot_be_split_is_one_line(model, plan, tp, said):
    with pytest.raises(DdpkitError, match=None) as raised:
        check_plan(model, resolve_plan(model, plan), tp)
    assert said in str(raised.value) and "\n" not in str(raised.value)


def test_a_head_count_attribute_must_divide_by_tp():
    model = Gpt(d=24, n_head=3)
    for block in model.blocks:
        block.attn.n_head = 3
    with pytest.raises(DdpkitError, match=r"blocks.0.attn.n_head = 3 heads do not divide by 2"):
        check_plan(model, resolve_plan(model, PLAN), 2)


def test_a_model_without_any_plan_is_refused():
    with pytest.raises(DdpkitError, match="has no tensor-parallel plan: give the task tp_plan"):
        plan_of(Gpt(), None)


def test_a_transformers_llama_brings_its_own_plan():
    import transformers  # the hf extra is among the test extras (Makefile TEST_EXTRAS): never skipped

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config)
    resolved = resolve_plan(model, plan_of(model, None))
    assert resolved["model.layers.1.self_attn.q_proj"] == "colwise"
    assert resolved["model.layers.0.mlp.down_proj"] == "rowwise"
    check_plan(model, resolved, 2)


def _llama(**config):
    import transformers

    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**sizes, "num_key_value_heads": 2, **config}))


def test_a_transformers_models_whole_plan_splits_its_embedding_and_head_too():
    model = _llama()
    resolved = resolve_plan(model, plan_of(model, None))
    assert resolved["model.embed_tokens"] == "embedding_rowwise"
    assert resolved["lm_head"] == "colwise_gather_output"  # the logits gathered whole for the loss
    assert len(resolved) == 2 + 7 * 2


def test_a_style_ddpkit_does_not_apply_is_named_in_one_line():
    model = _llama()
    model._tp_plan = {**model._tp_plan, "model.layers.*.mlp.up_proj": "packed_colwise"}
    with pytest.raises(DdpkitError) as raised:
        resolve_plan(model, plan_of(model, None))
    said = str(raised.value)
    assert "'model.layers.*.mlp.up_proj': style 'packed_colwise' is not one ddpkit applies" in said
    assert "\n" not in said


def test_a_split_that_would_cut_a_head_in_two_is_refused():
    model = _llama(num_key_value_heads=1)  # k_proj and v_proj: one head of 8 features each
    with pytest.raises(DdpkitError) as raised:
        check_plan(model, resolve_plan(model, plan_of(model, None)), 2)
    assert "model.layers.0.self_attn.k_proj holds 1 head(s) of 8 features" in str(raised.value)
    check_plan(_llama(), resolve_plan(_llama(), plan_of(_llama(), None)), 2)  # 2 kv heads: one per rank


def test_a_tied_head_split_one_way_and_its_embedding_another_is_refused():
    model = _llama(tie_word_embeddings=True)
    plan = {**model._tp_plan, "model.embed_tokens": "embedding_colwise"}  # the head still splits rows
    with pytest.raises(DdpkitError, match="one tied parameter would be split two ways") as raised:
        check_plan(model, resolve_plan(model, plan), 2)
    assert "lm_head.weight split on dim 0" in str(raised.value)
    check_plan(model, resolve_plan(model, plan_of(model, None)), 2)  # rows and rows: one parameter kept
