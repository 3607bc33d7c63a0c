"""The FLOPs of one sample, counted once on the meta device (training/flops.py), against what
they must be on paper; the tokens a sample holds; and what a run's rates are made of."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit import DistEnv, RunConfig
from ddpkit.runtime import Runtime
from ddpkit.tasks import wine
from ddpkit.training.flops import count_flops, first_sample, on_meta, throughput_of, tokens_in

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import gpt  # noqa: E402  (examples/gpt.py)


def gpt_analytic(cfg: gpt.GPTConfig) -> int:
    """The FLOPs of one sample of T tokens through examples/gpt.py's GPT, forward + backward.

    Forward, per token: every weight of a matrix product costs a multiply and an add, 2 FLOPs.
    A block holds 12 d^2 of them (qkv 3 d^2, the attention's projection d^2, the MLP's up and
    down 4 d^2 each); the head V d (it shares the token embedding's matrix; the embedding
    lookups themselves are no products). Attention adds two products per layer over the T
    positions: the scores Q K^T (2 T d a token, summed over the heads) and their weighting of V
    (2 T d): 4 L T d. The backward costs twice the forward (the gradients of each product's
    input and of its weight). So, per token, with N = 12 L d^2 + V d (the matrices):

        6 N + 12 L T d

    the formula of PaLM's appendix B (and nanoGPT's estimate_mfu), which counts the full T x T
    attention, the causal mask's half included; per sample, T times that. Biases, norms, GELU
    and the softmax are left out, as there."""
    L, d, T, V = cfg.n_layer, cfg.n_embd, cfg.block_size, cfg.vocab_size
    n = 12 * L * d * d + V * d
    return (6 * n + 12 * L * T * d) * T


def synthetic(cfg: gpt.GPTConfig) -> dict[str, torch.Tensor]:
    ids = torch.zeros(cfg.block_size, dtype=torch.long)
    return {"idx": ids, "targets": ids}


def test_the_gpt_examples_counted_flops_are_within_3_percent_of_6n_plus_attention():
    task = gpt.build(None)  # the example as ddpkit trains it: its data, its loss
    flops, note = count_flops(task, 16, first_sample(task.train_set))
    assert note == ""
    expected = gpt_analytic(task.model.cfg)
    assert abs(flops / expected - 1) < 0.03, (flops, expected)


@pytest.mark.parametrize(
    "shape",
    [
        dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),  # GPT-2 small
        dict(vocab_size=1000, block_size=256, n_layer=3, n_head=8, n_embd=256),
    ],
)
def test_larger_gpts_built_on_the_meta_device_count_as_the_formula_says(shape):
    cfg = gpt.GPTConfig(**shape)
    with torch.device("meta"):  # GPT-2 small's 124M parameters: shapes only, no memory
        model = gpt.GPT(cfg)
    task = ddpkit.Task(model=model, train_set=[synthetic(cfg)], optimizer=torch.optim.SGD)
    flops, _ = count_flops(task, 4, first_sample(task.train_set))
    assert abs(flops / gpt_analytic(cfg) - 1) < 0.03


def test_the_count_is_per_sample_whatever_the_micro_batch():
    task = gpt.build(None, n_layer=1, max_samples=8)
    sample = first_sample(task.train_set)
    one, _ = count_flops(task, 1, sample)
    assert count_flops(task, 5, sample)[0] == pytest.approx(one)


def test_wines_count_is_its_products_forward_and_backward_without_the_datas_gradient():
    """Linear(13, 64)-ReLU-Linear(64, 3): forward 2 (13*64 + 64*3) = 2048; backward the same
    for the weight gradients and 2*64*3 for the hidden layer's input; the data's gradient is
    never computed (it needs none): 4480, not 3 x 2048."""
    task = wine.build(None)
    assert count_flops(task, 32, first_sample(task.train_set)) == (4480.0, "")


def test_counting_leaves_the_model_as_it_was_and_keeps_tied_weights_tied():
    task = gpt.build(None, n_layer=1, max_samples=8)
    before = {k: v.clone() for k, v in task.model.state_dict().items()}
    with on_meta(task.model) as model:
        assert model.head.weight is model.wte.weight and model.head.weight.is_meta
    task.model.eval()
    count_flops(task, 2, first_sample(task.train_set))
    assert not task.model.training and task.model.head.weight is task.model.wte.weight
    after = task.model.state_dict()
    assert all(not v.is_meta and torch.equal(v, after[k]) for k, v in before.items())
    assert all(p.grad is None for p in task.model.parameters())


def test_a_model_that_does_not_deep_copy_is_counted_all_the_same():
    """The hang watchdog's forward hook holds a lock (so does a user's handle): the count swaps
    the tensors in place instead of copying the model, whose hooks it sets aside meanwhile."""
    import threading

    task = wine.build(None)
    lock, beats = threading.Lock(), []
    task.model.register_forward_pre_hook(lambda module, args: beats.append(lock.locked()))
    assert count_flops(task, 8, first_sample(task.train_set)) == (4480.0, "")
    assert beats == []  # set aside for the count
    assert len(task.model._forward_pre_hooks) == 1  # and back after it


class ReadsItsData(nn.Module):
    """A forward that needs the values (a data-dependent branch): nothing to run on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(x) if x.sum().item() > 0 else self.lin(-x)


def test_a_model_that_cannot_run_on_the_meta_device_is_not_counted_and_says_why():
    task = ddpkit.Task(model=ReadsItsData(), train_set=[(torch.ones(4), torch.tensor(1))], optimizer=torch.optim.SGD)
    flops, note = count_flops(task, 2, first_sample(task.train_set))
    assert flops is None and "on the meta device failed" in note


def test_a_sample_of_token_ids_holds_its_length_in_tokens_features_and_labels_none():
    assert tokens_in({"idx": torch.zeros(64, dtype=torch.long), "targets": torch.zeros(64, dtype=torch.long)}) == 64
    assert tokens_in((torch.zeros(13), torch.tensor(2))) is None  # Wine: features and a class
    assert tokens_in((torch.zeros(1, 8, 8), torch.tensor(3))) is None  # an image
    assert tokens_in(None) is None


@pytest.fixture(scope="module")
def rt():
    with Runtime(DistEnv(), device="cpu", threads=1) as r:
        yield r


def test_a_runs_throughput_on_a_cpu_has_an_mfu_only_with_a_given_peak(rt):
    task = gpt.build(None, n_layer=1, max_samples=8)
    plain = throughput_of(task, RunConfig(batch_size=4), rt, "fp32")
    assert plain.tokens_per_sample == 64 and plain.flops_per_sample > 0
    assert plain.peak_tflops is None and "--peak-tflops" in plain.peak_source
    assert "mfu" not in plain.rates(100.0) and plain.rates(100.0)["tokens_per_s"] == 6400
    given = throughput_of(task, RunConfig(batch_size=4, peak_tflops=2.0), rt, "fp32")
    assert (given.peak_tflops, given.peak_source) == (2.0, "--peak-tflops")
    rates = given.rates(100.0)
    assert rates["mfu"] == pytest.approx(given.flops_per_sample * 100.0 / 1e12 / 2.0, rel=1e-5)


def test_a_task_may_say_how_many_tokens_its_samples_hold(rt):
    task = wine.build(None)
    task.tokens_per_sample = 13
    assert throughput_of(task, RunConfig(), rt, "fp32").tokens_per_sample == 13
    gpt_task = gpt.build(None, n_layer=1, max_samples=8)
    gpt_task.tokens_per_sample = 0  # none, whatever the samples look like
    assert throughput_of(gpt_task, RunConfig(), rt, "fp32").tokens_per_sample is None


def test_the_count_calls_no_hook_of_the_model_and_leaves_every_hook_in_place():
    """A user's hook counts training forwards (to fail, sleep or log at the Nth): the count is no
    training forward, so no module's forward or backward hook sees it; each is back after it."""
    task = wine.build(None)
    calls = []
    task.model.register_forward_pre_hook(lambda m, args: calls.append("pre"))
    task.model[0].register_forward_hook(lambda m, args, out: calls.append("post"))
    task.model[2].register_full_backward_hook(lambda m, gi, go: calls.append("backward"))
    assert count_flops(task, 8, first_sample(task.train_set))[0] == 4480.0
    assert calls == []
    x, y = first_sample(task.train_set)
    task.model(x[None]).sum().backward()
    assert calls == ["pre", "post", "backward"]


def test_the_count_never_calls_the_tasks_loss_function_and_counts_the_same():
    task = wine.build(None)
    calls = []
    inner = task.loss_fn

    def counted(out, y):
        calls.append(out.device.type)
        return inner(out, y)

    task = ddpkit.Task(model=task.model, train_set=task.train_set, optimizer=task.optimizer, loss_fn=counted)
    assert count_flops(task, 8, first_sample(task.train_set)) == (4480.0, "") and calls == []


def test_a_hugging_face_gpt2_is_estimated_from_its_config_as_6n_plus_12ltd():
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    import hf_transformers as hf  # examples/: a GPT-2 from a config, nothing downloaded

    from ddpkit.training.flops import config_flops

    model = hf.gpt2_model(100, 32, n_layer=3, n_head=2, n_embd=16)
    sample = {"input_ids": torch.ones(32, dtype=torch.long), "labels": torch.ones(32, dtype=torch.long)}
    task = ddpkit.Task(model=model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), train_set=[sample])
    assert count_flops(task, 2, sample)[0] is None  # its mask code reads values: the meta device cannot run it
    n = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()  # the tied head kept
    assert config_flops(model, 32) == (6 * n + 12 * 3 * 32 * 16) * 32
    cfg = RunConfig(peak_tflops=0.5)
    with Runtime(DistEnv(), device="cpu", threads=1) as rt:
        t = throughput_of(task, cfg, rt, "fp32")
    assert t.flops_per_sample == config_flops(model, 32) and t.note.startswith("estimated from the model's config")
    assert t.rates(100.0)["mfu"] > 0
    assert config_flops(nn.Linear(2, 2), 32) is None  # not a transformers model: not estimated
