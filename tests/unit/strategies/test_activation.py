"""--activation-checkpointing on one process: which blocks are hooked, that names and results
stay the same, and the refusals (2 ranks, DDP and FSDP: tests/distributed/test_activation_checkpointing.py)."""

import sys

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from conftest import REPO
from ddpkit import DdpkitError, DistEnv, RunConfig, Task
from ddpkit.cli import build_parser
from ddpkit.cli.flags import config_from
from ddpkit.runtime import Runtime
from ddpkit.strategies import make_strategy
from ddpkit.strategies.activation import checkpoint_blocks, is_checkpointed

sys.path.insert(0, str(REPO / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402


def _gpt(dropout=0.0):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=13, block_size=8, n_layer=3, n_head=2, n_embd=8, dropout=dropout)).double()


@pytest.fixture
def rt():
    with Runtime(DistEnv(), device="cpu", threads=1) as r:
        yield r


def _task(model, **hooks):
    data = TensorDataset(torch.zeros(4, 8, dtype=torch.long))
    return Task(model=model, train_set=data, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), **hooks)


def test_the_flag_checkpoints_each_fsdp_block_of_the_unwrapped_model_and_keeps_its_names(rt):
    cfg = config_from(build_parser().parse_args(["train", "--activation-checkpointing"]))
    assert cfg.strategy_config().activation_checkpointing
    plan = config_from(build_parser().parse_args(["plan", "--activation-checkpointing"]))
    assert plan.activation_checkpointing
    model = _gpt()
    keys = list(model.state_dict())
    strategy = make_strategy(cfg.replace(nproc=1), rt, _task(model))
    wrapped = strategy.setup_module(model)
    assert [n for n, m in wrapped.named_modules() if is_checkpointed(m)] == ["blocks.0", "blocks.1", "blocks.2"]
    assert strategy.checkpointed == list(model.blocks)
    assert list(wrapped.state_dict()) == keys  # a hook, not a wrapper module: the same checkpoint keys
    plain = make_strategy(RunConfig(nproc=1), rt, _task(other := _gpt())).setup_module(other)
    assert not any(is_checkpointed(m) for m in plain.modules())


def test_the_tasks_checkpoint_blocks_hook_chooses_else_its_fsdp_blocks(rt):
    cfg = RunConfig(nproc=1, activation_checkpointing=True)
    model = _gpt()
    make_strategy(cfg, rt, _task(model, checkpoint_blocks=lambda m: [m.blocks[1]])).setup_module(model)
    assert [n for n, m in model.named_modules() if is_checkpointed(m)] == ["blocks.1"]
    model = _gpt()
    make_strategy(cfg, rt, _task(model, fsdp_blocks=lambda m: [m.blocks[0].mlp])).setup_module(model)
    assert [n for n, m in model.named_modules() if is_checkpointed(m)] == ["blocks.0.mlp"]


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_gradients_are_bit_equal_with_and_without_it_dropout_included(dropout):
    idx = torch.randint(0, 13, (3, 8), generator=torch.Generator().manual_seed(1))
    grads = []
    for on in (False, True):
        model = _gpt(dropout)
        if on:
            checkpoint_blocks(model)
        torch.manual_seed(7)  # the same dropout masks in both forwards; the recomputation must redraw them
        model(idx, targets=idx.roll(1, dims=1))[1].backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n


def test_a_model_without_blocks_is_one_clear_error(rt):
    cfg = RunConfig(nproc=1, activation_checkpointing=True)
    model = nn.Linear(4, 2)
    with pytest.raises(DdpkitError, match="activation checkpointing found no blocks to checkpoint in Linear"):
        make_strategy(cfg, rt, _task(model)).setup_module(model)


@pytest.mark.parametrize(
    "blocks, message",
    [
        (lambda m: [m], "must return submodules of the model"),
        (lambda m: [nn.Linear(2, 2)], "must return submodules of the model"),
        (lambda m: [m.blocks[0], m.blocks[0].mlp], "a block inside another"),
        (lambda m: [m.blocks[0], m.blocks[0]], "a block twice"),
    ],
)
def test_the_hook_must_name_each_block_of_the_model_once(blocks, message):
    with pytest.raises(DdpkitError, match=message):
        checkpoint_blocks(_gpt(), blocks)


def test_a_checkpoint_blocks_hook_that_is_not_a_function_is_refused():
    with pytest.raises(DdpkitError, match="checkpoint_blocks must be a function of the model"):
        from ddpkit.task import as_task

        as_task(_task(_gpt(), checkpoint_blocks=[1]))


def test_the_plan_estimates_what_a_forward_keeps_with_and_without_checkpointing_at_any_batch():
    from ddpkit.planning.memory import make_plan
    from ddpkit.strategies.activation import SavedBytes
    from ddpkit.training.probe import estimate_activations

    model = _gpt()
    windows = [{"idx": i, "targets": i.roll(1)} for i in torch.randint(0, 13, (5, 8))]
    estimate = estimate_activations(Task(model=model, train_set=windows, optimizer=None), 5, lambda m: m.blocks)
    measured = {}
    for on in (False, True):
        m = _gpt()
        with SavedBytes(checkpoint_blocks(m) if on else ()) as saved:
            m(torch.stack([w["idx"] for w in windows]), targets=torch.stack([w["targets"] for w in windows]))
        measured[on] = saved.kept()
    assert (estimate.kept, estimate.kept_checkpointed) == (measured[False], measured[True])
    assert 0 < estimate.kept_checkpointed < estimate.kept / 3 and 0 < estimate.recomputed < estimate.kept / 2
    plan = make_plan(model, lambda p: torch.optim.SGD(p, lr=0.1), 2, "fp32", 10**9, "x", activations=estimate)
    text = plan.format("gpt")
    assert (
        "(at --batch-size 5, kept for backward; checkpointing off)" in text and "(--activation-checkpointing)" in text
    )
    # the peak counts the activations at the micro-batch asked, and a step's gradients through one block
    assert plan.peak("ddp").activations == estimate.kept + estimate.recomputed
    assert plan.peak("ddp", batch_size=1).activations == estimate.at(1).kept + estimate.at(1).recomputed
    assert estimate.at(1).kept < estimate.kept and estimate.at(5) == estimate


def test_a_model_on_the_meta_device_is_probed_on_a_copy_in_memory_or_if_too_large_on_meta(monkeypatch):
    from ddpkit.training import probe

    with torch.device("meta"):
        model = _gpt()
    copy, device = probe._probe_model(model, "fp32")
    assert device.type == "cpu" and not any(p.is_meta for p in copy.parameters())
    monkeypatch.setattr(probe, "REAL_PROBE_MAX", 0)
    assert probe._probe_model(model, "fp32")[1].type == "meta"  # too large to hold: shapes only
    assert all(p.is_meta for p in model.parameters())  # the task's own model stays as it was


def test_the_meta_probe_counts_what_a_real_forward_keeps(monkeypatch):
    from ddpkit.training import probe
    from ddpkit.training.probe import estimate_activations

    monkeypatch.setattr(probe, "REAL_PROBE_MAX", 0)
    with torch.device("meta"):
        model = _gpt()
    windows = [{"idx": i, "targets": i.roll(1)} for i in torch.randint(0, 13, (4, 8))]
    on_meta = estimate_activations(Task(model=model, train_set=windows, optimizer=None), 8, lambda m: m.blocks)
    eager = estimate_activations(Task(model=_gpt(), train_set=windows, optimizer=None), 8, lambda m: m.blocks)
    figures = lambda e: (e.kept, e.kept_checkpointed, e.recomputed, *e.per_sample)  # noqa: E731
    assert on_meta.on_meta and not eager.on_meta and on_meta.kept > 0
    # on the meta device attention saves its math path's buffers, not the CPU's fused kernel's: close here
    assert figures(on_meta) == pytest.approx(figures(eager), rel=0.05)


def test_with_compile_it_is_accepted_before_anything_starts():
    """Each checkpointed block's forward is compiled (tests/unit/strategies/test_compiling.py)."""
    cfg = RunConfig(activation_checkpointing=True, compile=True)
    assert cfg.strategy_config().compile and cfg.strategy_config().activation_checkpointing


def test_a_hugging_face_model_recomputes_its_blocks_without_its_key_value_cache():
    """GPT-2 in training fills a key/value cache its blocks share: recomputing a block would
    attend over its keys twice (a crash). Checkpointing turns the cache off, as transformers'
    own gradient checkpointing does, and the gradients equal the plain model's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2, use_cache=True, bos_token_id=0)
    config.eos_token_id = 0
    torch.manual_seed(0)
    plain, hooked = GPT2LMHeadModel(config), GPT2LMHeadModel(config)
    hooked.load_state_dict(plain.state_dict())
    checkpoint_blocks(hooked)
    ids = torch.randint(0, 50, (3, 12))
    mask = torch.ones_like(ids)
    mask[:, 9:] = 0  # padded at the end, as a batch of texts of several lengths
    grads = []
    for model in (plain, hooked):
        model.train()
        torch.manual_seed(7)  # the same dropout masks in both (the recomputation redraws them)
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-7, msg=name)
    assert hooked.config.use_cache is False
