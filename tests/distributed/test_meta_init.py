"""Models built on the meta device, through the real CLI: each rank materialises only its
shards, initialised as the eager build is (the same model at any world size), pretrained
weights are read by slice into them, and a setup's peak memory per rank is 1/N of the model
plus one block, not the whole model. Bad inputs are one line and exit 2."""

import importlib.util
import json

import pytest
import torch

from conftest import REPO, assert_state_close, load_model, run_ddpkit

GPT = str(REPO / "examples" / "gpt.py") + ":build"
HF_EXACT = str(REPO / "examples" / "hf_transformers.py") + ":build_exact"
TINY = ["--task-arg", "n_layer=2", "--task-arg", "n_head=2", "--task-arg", "n_embd=32", "--task-arg", "max_samples=56"]
GPT_TINY = TINY + ["--task-arg", "block_size=32", "--task-arg", "warmup_steps=3"]
# three optimizer steps of a global batch of 16
COMMON = ["--epochs", "1", "--max-steps", "3", "--seed", "7", "--threads", "1", "--quiet", "--save-every", "0"]
LAYOUTS = {
    "1x16": ("1", "16", "ddp"),
    "2x8": ("2", "8", "fsdp"),
    "4x4": ("4", "4", "fsdp"),
    "hsdp 2x2x4": ("4", "4", "hsdp"),  # 2 replicas of 2 shards: the 2-D mesh's slices
}


def _args(task, layout, *extra):
    nproc, batch, strategy = LAYOUTS[layout]
    mesh = ("--replicate", "2") if strategy == "hsdp" else ()
    return (task, "--nproc", nproc, "--batch-size", batch, "--strategy", strategy, *mesh, *COMMON, *extra)


def _train(run_dir, *args):
    return run_ddpkit("train", *args, "--run-dir", str(run_dir))


def _peaks(run_dir):
    return json.loads((run_dir / "summary.json").read_text())["peak_memory_bytes"]


@pytest.mark.slow
def test_gpt_built_on_meta_trains_to_the_eager_model_under_fsdp_2x8_4x4_and_hsdp(reference_run, tmp_path):
    eager = load_model(reference_run(*_args(GPT, "1x16", *GPT_TINY)))
    for layout in ("2x8", "4x4", "hsdp 2x2x4"):
        run = tmp_path / layout.replace(" ", "-")
        _train(run, *_args(GPT, layout, *GPT_TINY, "--task-arg", "init=meta"))
        # within 1e-5: AdamW turns the attention key bias's rounding-noise gradient into steps of ~1e-6
        assert_state_close(load_model(run), eager, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def saved_gpt2(tmp_path_factory):
    """A tiny GPT2LMHeadModel written by save_pretrained (model.safetensors, the tied head saved once)."""
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    spec = importlib.util.spec_from_file_location("example_hf_transformers", REPO / "examples" / "hf_transformers.py")
    hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf)
    folder = tmp_path_factory.mktemp("gpt2") / "saved"
    torch.manual_seed(3)
    _, _, chars = hf.doc_data(32, 56)
    hf.gpt2_model(len(chars) + 1, 32, n_layer=2, n_head=2, n_embd=32).save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_hf_gpt2_on_meta_fine_tuned_from_its_saved_folder_ends_where_from_pretrained_ends(saved_gpt2, tmp_path):
    from safetensors.torch import load_file

    # lr 1e-3: AdamW's steps on the attention bias's rounding noise stay well inside 1e-5
    pretrained = ["--task-arg", f"pretrained={saved_gpt2}", "--task-arg", "max_length=32", "--lr", "1e-3"]
    pretrained += ["--task-arg", "max_samples=56"]
    _train(tmp_path / "eager", *_args(HF_EXACT, "1x16", *pretrained))
    _train(tmp_path / "meta", *_args(HF_EXACT, "2x8", *pretrained, "--task-arg", "init=meta"))
    eager, meta = load_model(tmp_path / "eager"), load_model(tmp_path / "meta")
    assert_state_close(meta, eager, rtol=1e-5, atol=1e-5)
    start = load_file(str(saved_gpt2 / "model.safetensors"))
    moved = max((meta[k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-3  # it trained from the saved weights (3 AdamW steps of lr 1e-3)
    peaks = _peaks(tmp_path / "meta")
    assert len(peaks) == 2 and all(p > 0 for p in peaks)
    print(f"per-rank peak memory: meta fsdp 2x8 {peaks}, from_pretrained 1x16 {_peaks(tmp_path / 'eager')}")


NO_RESET = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
import ddpkit

class Gain(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = nn.Parameter(torch.ones(2))

    def forward(self, x):
        return x * self.g

def build(config=None):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 2), Gain())
    return ddpkit.Task(model=model, train_set=TensorDataset(torch.randn(8, 3), torch.zeros(8, dtype=torch.long)),
                       optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
"""


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["bad.py:build"], "1 (Gain) has no reset_parameters() to initialise"),
        ([GPT, *GPT_TINY, "--task-arg", "init=meta", "--init-from", "cut.safetensors"], "not a readable safetensors"),
    ],
)
def test_bad_meta_inputs_are_one_line_and_exit_2_with_nothing_written(tmp_path, args, fragment):
    (tmp_path / "bad.py").write_text(NO_RESET)
    (tmp_path / "cut.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    proc = run_ddpkit(
        "train", *args, "--nproc", "1", "--epochs", "1", "--threads", "1", "--run-dir", "run",
        cwd=tmp_path, check=False, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpkit: error: ") and fragment in lines[0], proc.stderr
    assert not list(tmp_path.rglob("model.pt")) and not list(tmp_path.rglob("checkpoints/*"))


@pytest.mark.slow
def test_a_2gb_meta_model_sets_up_on_4_ranks_within_its_shards_and_one_block(tmp_path):
    """Measured in each worker around rt.wrap (tests/distributed/scripts/meta_setup_memory.py)."""
    script = str(REPO / "tests" / "distributed" / "scripts" / "meta_setup_memory.py")
    run_ddpkit("launch", "--nproc", "4", script, str(tmp_path), timeout=400)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(4)]
    overhead = 256 * 2**20  # the mesh, FSDP's bookkeeping, allocator slack
    for r in ranks:
        assert r["model"] >= 2 * 10**9 and r["initialised"] and r["same_draw"]
        assert r["local"] <= r["model"] / 4 + 4096
        bound = r["model"] / 4 + r["block"] + overhead
        assert r["peak"] < bound, f"peak {r['peak'] / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB"
        assert r["peak"] < r["model"] / 2  # an eager build holds the whole model first
    print("per-rank setup peak (MiB):", [round(r["peak"] / 2**20) for r in ranks])
