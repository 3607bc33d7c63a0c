"""A model built on the meta device, materialised on one process (the whole of each tensor: the
DDP path; the FSDP path's slices are tested in tests/distributed/test_meta_init.py), and
pretrained weights read from each kind of source, with one line for each bad one."""

import importlib.util
import json
import sys

import pytest
import torch
from torch import nn

from conftest import REPO
from ddpkit import DdpkitError
from ddpkit.checkpoint.pretrained import open_pretrained, tensor_names
from ddpkit.planning.memory import make_plan
from ddpkit.strategies.fsdp import default_blocks
from ddpkit.strategies.materialize import ModelInit, fill, on_meta

CPU = torch.device("cpu")


def _example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", REPO / "examples" / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpt = _example("gpt")
deep_mlp = _example("deep_mlp")


def _gpt(device):
    with torch.device(device):
        return gpt.GPT(gpt.GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=16))


class WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.norm = nn.BatchNorm1d(6)  # running_mean/var, num_batches_tracked: set by its reset_parameters
        self.scale = Scale(6)


class Scale(nn.Module):
    """A non-persistent buffer, recomputed by reset_parameters (as a rotary cache would be)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n))
        self.register_buffer("steps", torch.empty(n), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.weight)
        with torch.no_grad():
            self.steps.copy_(torch.arange(self.steps.numel(), dtype=self.steps.dtype))


def _same(a: nn.Module, b: nn.Module) -> None:
    sa, sb = dict(a.named_parameters()), dict(b.named_parameters())
    sa.update(a.named_buffers())
    sb.update(b.named_buffers())
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_building_on_meta_draws_nothing_from_the_cpu_rng():
    before = torch.get_rng_state()
    model = _gpt("meta")
    assert on_meta(model) and torch.equal(torch.get_rng_state(), before)


def test_meta_gpt_with_its_init_hook_equals_the_eager_build_and_keeps_the_tie():
    torch.manual_seed(3)
    eager = _gpt("cpu")
    meta = fill(_gpt("meta"), CPU, ModelInit(init_weights=gpt.init_weights, seed=3))
    assert not on_meta(meta)
    _same(meta, eager)
    assert meta.head.weight is meta.wte.weight


@pytest.mark.parametrize("make", [lambda: deep_mlp.DeepMLP(8, 16, 3, 4), WithBuffers])
def test_meta_model_with_reset_parameters_equals_the_eager_build_buffers_too(make):
    torch.manual_seed(5)
    eager = make()
    with torch.device("meta"):
        meta = make()
    _same(fill(meta, CPU, ModelInit(seed=5)), eager)


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))


class HalfReset(nn.Linear):
    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)  # leaves the bias as it was (nothing, on meta)


def test_a_module_without_reset_parameters_is_named_and_the_hook_is_the_way_out():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), NoReset())
    with pytest.raises(DdpkitError, match=r"2 \(NoReset\) has no reset_parameters\(\).*init_weights"):
        fill(model, CPU, ModelInit())
    fill(model, CPU, ModelInit(init_weights=lambda m: nn.init.constant_(m.w, 2.0) if isinstance(m, NoReset) else None))
    assert torch.equal(model[2].w, torch.full((3,), 2.0))
    with torch.device("meta"):
        half = nn.Sequential(HalfReset(2, 3))
    with pytest.raises(DdpkitError, match=r"left 0.bias \(HalfReset\) unset"):
        fill(half, CPU, ModelInit())


# ---------------------------------------------------------------------------- pretrained weights


def _save_safetensors(state, path):
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(path))


@pytest.mark.parametrize("kind", ["safetensors", "torch", "hf-folder", "hf-sharded"])
def test_pretrained_weights_fill_a_meta_model_from_each_kind_of_source(tmp_path, kind):
    pytest.importorskip("safetensors", reason="the hf extra (safetensors) is not installed")
    torch.manual_seed(0)
    source = WithBuffers()
    source.norm.running_mean += 1.5
    state = {k: v for k, v in source.state_dict().items() if k != "norm.num_batches_tracked"}
    if kind == "safetensors":
        path = tmp_path / "w.safetensors"
        _save_safetensors(state, path)
    elif kind == "torch":
        path = tmp_path / "model.pt"
        torch.save(state, path)
    elif kind == "hf-folder":
        path = tmp_path
        _save_safetensors(state, tmp_path / "model.safetensors")
    else:
        path = tmp_path
        keys = sorted(state)
        halves = {"model-00001-of-00002.safetensors": keys[:3], "model-00002-of-00002.safetensors": keys[3:]}
        for file, part in halves.items():
            _save_safetensors({k: state[k] for k in part}, tmp_path / file)
        index = {"weight_map": {k: f for f, part in halves.items() for k in part}}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with torch.device("meta"):
        model = WithBuffers()
    fill(model, CPU, ModelInit(init_from=str(path), seed=1))
    for k, v in state.items():
        assert torch.equal(model.state_dict()[k], v), k
    assert int(model.norm.num_batches_tracked) == 0  # not in the file: its initialised value
    assert torch.equal(model.scale.steps, torch.arange(6.0))  # non-persistent: initialised


def test_pretrained_weights_into_a_meta_or_eager_model_under_any_of_a_tied_names(tmp_path):
    torch.manual_seed(0)
    trained = _gpt("cpu")
    state = {k: v for k, v in trained.state_dict().items() if k != "head.weight"}  # saved once, as HF does
    torch.save(state, tmp_path / "w.pt")
    for device in ("meta", "cpu"):  # built on meta, or eagerly (other weights, replaced)
        model = fill(_gpt(device), CPU, ModelInit(init_from=str(tmp_path / "w.pt")))
        _same(model, trained)
        assert model.head.weight is model.wte.weight


def _bad_sources(tmp_path):
    torch.manual_seed(0)
    good = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    torch.save(good.state_dict(), tmp_path / "good.pt")
    _save_safetensors(good.state_dict(), tmp_path / "good.safetensors")
    blob = (tmp_path / "good.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(blob[: len(blob) // 2])
    blob = (tmp_path / "good.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(blob[: len(blob) // 2])
    torch.save(nn.Linear(3, 3).state_dict() | {"other.weight": torch.zeros(1)}, tmp_path / "other.pt")
    torch.save({k: v for k, v in good.state_dict().items() if k != "1.bias"}, tmp_path / "missing.pt")
    torch.save(good.state_dict() | {"2.weight": torch.zeros(1)}, tmp_path / "extra.pt")
    torch.save(nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 2)).state_dict(), tmp_path / "shape.pt")
    (tmp_path / "empty_dir").mkdir()


@pytest.mark.parametrize(
    "name, fragment",
    [
        ("nowhere.safetensors", "no such file or folder"),
        ("cut.safetensors", "not a readable safetensors file"),
        ("cut.pt", "not a readable torch state dict"),
        ("other.pt", "none of its keys is the model's"),
        ("missing.pt", "parameter '1.bias' is not in the file"),
        ("extra.pt", "key '2.weight' is not in the model"),
        ("shape.pt", "'0.weight' has shape [5, 4] in the file but [6, 4] in the model"),
        ("empty_dir", "holds no model.safetensors"),
    ],
)
def test_bad_pretrained_sources_are_one_line_naming_the_first_problem(tmp_path, name, fragment):
    pytest.importorskip("safetensors", reason="the hf extra (safetensors) is not installed")
    _bad_sources(tmp_path)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    with pytest.raises(DdpkitError, match="pretrained weights") as e:
        open_pretrained(tmp_path / name, tensor_names(model))
    assert fragment in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------- the plan


def test_plan_counts_the_setup_peak_of_a_meta_build_and_of_an_eager_one():
    for device in ("meta", "cpu"):
        with torch.device(device):
            model = deep_mlp.DeepMLP(32, 64, 4, 4)  # 4 blocks of 33,472 parameters; 2,372 at the root
        plan = make_plan(
            model, torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), 4, "fp32", 2**30, "given", default_blocks
        )
        whole = sum(p.numel() for p in model.parameters()) * 4
        block = sum(p.numel() for p in model.blocks[0].parameters()) * 4
        assert plan.setup_eager == whole
        assert plan.setup_meta == plan.fsdp.params + block
        assert plan.setup_meta < whole / 2
        assert plan.built_on_meta == (device == "meta")
        lines = plan.format("deep", "fsdp").splitlines()
        setup = [line for line in lines if line.lstrip().startswith("setup")]
        assert len(setup) == 2 and "<- this task" in setup[1 if device == "meta" else 0]
