"""--compile's backend choice and what it compiles (strategies/compiling.py): each block's own
forward, inside the hooks, so that activation checkpointing still recomputes it and parameter
names stay; inductor where a compiler is found, else aot_eager with the reason."""

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
import torch
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd

from ddpkit import DistEnv, RunConfig, Task
from ddpkit.runtime import Runtime
from ddpkit.strategies import make_strategy
from ddpkit.strategies.activation import checkpoint_blocks
from ddpkit.strategies.compiling import choose_backend, compile_forwards

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402


def test_without_a_cpp_compiler_the_cpu_falls_back_to_aot_eager_and_says_why(tmp_path):
    choice = choose_backend("cpu", path=str(tmp_path))  # an empty folder as PATH: no g++
    assert choice.backend == "aot_eager"
    assert "no C++ compiler (g++) on PATH" in choice.why and "inductor builds its CPU kernels" in choice.why


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ here: the fallback is what runs (checked above)")
def test_with_gpp_on_path_the_cpu_gets_inductor():
    choice = choose_backend("cpu")
    assert choice.backend == "inductor" and choice.why == "the default: C++ kernels built with g++"


def test_a_gpu_without_triton_or_a_c_compiler_falls_back_to_aot_eager(tmp_path):
    choice = choose_backend("cuda", path=str(tmp_path))  # the decision needs no GPU
    assert choice.backend == "aot_eager"
    if importlib.util.find_spec("triton") is None:
        assert choice.why.startswith("triton is not installed")
    else:
        assert choice.why.startswith("no C compiler")


class _Counting:
    """aot_eager with counters: how often the compiled forward and backward graphs run."""

    def __init__(self):
        self.forward = self.backward = 0
        self.backend = aot_autograd(fw_compiler=self._counted("forward"), bw_compiler=self._counted("backward"))

    def _counted(self, which):
        def compiler(gm, _inputs):
            def run(*args):
                setattr(self, which, getattr(self, which) + 1)
                return gm(*args)

            return make_boxed_func(run)

        return compiler


def _blocks():
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))


def _grads(blocks, x):
    for block in blocks:
        x = block(x)
    x.square().sum().backward()
    return [p.grad.clone() for p in blocks.parameters()]


@pytest.mark.parametrize("checkpointed", [False, True])
def test_each_blocks_forward_is_compiled_inside_its_hooks(checkpointed):
    """A block of torch's own layers compiles too (module.compile() would compile nothing of an
    nn.Sequential: dynamo skips torch.nn's frames); its names stay; checkpointing recomputes the
    compiled forward in backward (one more forward graph run per block); the gradients are eager's."""
    x = torch.randn(4, 8)
    eager = _grads(_blocks(), x)
    blocks, counting = _blocks(), _Counting()
    names = [n for n, _ in blocks.named_parameters()]
    if checkpointed:
        checkpoint_blocks(blocks, lambda m: list(m))
    assert compile_forwards(blocks, counting.backend) == 2
    assert compile_forwards(blocks, counting.backend) == 2  # a second call compiles nothing again
    grads = _grads(blocks, x)
    assert counting.forward == (4 if checkpointed else 2) and counting.backward == 2
    assert [n for n, _ in blocks.named_parameters()] == names and list(blocks.state_dict()) == names
    for got, want in zip(grads, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.fixture
def rt():
    with Runtime(DistEnv(), device="cpu", threads=1) as r:
        yield r


def _task(model):
    data = [{"idx": torch.zeros(8, dtype=torch.long), "targets": torch.zeros(8, dtype=torch.long)}]
    return Task(model=model, train_set=data, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))


def _gpt():
    return GPT(GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=8))


def test_ddp_compiles_the_whole_model_without_checkpointing_and_each_block_with_it(rt, monkeypatch):
    """The record summary.json shows; the whole DDP model without checkpointing (DDP's
    optimizer), each checkpointed block's forward with it (the root eager)."""
    monkeypatch.setenv("PATH", "")  # no C++ compiler: aot_eager, so the test needs none
    whole = make_strategy(RunConfig(nproc=1, compile=True), rt, _task(model := _gpt()))
    compiled = whole.setup_module(model)
    assert whole.compiled == {"backend": "aot_eager", "why": whole.compile_choice.why, "what": "model"}
    assert type(compiled).__name__ == "OptimizedModule"
    cfg = RunConfig(nproc=1, compile=True, activation_checkpointing=True)
    per_block = make_strategy(cfg, rt, _task(model := _gpt()))
    assert per_block.setup_module(model) is model
    assert per_block.compiled == {
        "backend": "aot_eager",
        "why": per_block.compile_choice.why,
        "what": "blocks",
        "blocks": 2,
    }
    assert all(getattr(b.forward, "_ddpkit_compiled", False) for b in model.blocks)
    assert not getattr(model.forward, "_ddpkit_compiled", False)  # the root stays eager
    loss = model(torch.zeros(2, 8, dtype=torch.long), targets=torch.ones(2, 8, dtype=torch.long))[1]
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_without_compile_nothing_is_recorded(rt):
    strategy = make_strategy(RunConfig(nproc=1), rt, _task(model := _gpt()))
    strategy.setup_module(model)
    assert strategy.compile_choice is None and strategy.compiled is None
