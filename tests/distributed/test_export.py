"""ddpkit export of real runs: a DDP run's model.pt and one-file checkpoints, split by
--max-shard-size; an FSDP run's shards (2 ranks) of a Hugging Face GPT-2, read in one process;
train --export hf and export --format hf write folders that from_pretrained loads, with the
trained weights and the tied embedding written once. The runs go through the real CLI; the
exports call its main() in this process (they start no process group), which keeps them quick."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, assert_state_equal, load_model, run_ddpkit
from ddpkit.cli.commands import main

HF = str(REPO / "examples" / "hf_transformers.py") + ":build"
HF_TINY = [
    *("--task-arg", "n_layer=2", "--task-arg", "n_head=2", "--task-arg", "n_embd=32"),
    *("--task-arg", "max_samples=56", "--task-arg", "max_length=32"),
]


def _export(capsys, *args):
    """`ddpkit export ARGS` (exit 0); its output."""
    assert main(["export", *map(str, args)]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def _weights(folder):
    """Every tensor of an export (one file, or the files its index names) and the files."""
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else []
    state = {}
    for name in files or ["model.safetensors"]:
        state.update(load_file(folder / name))
    return state, files


@pytest.fixture(scope="module")
def hf_fsdp_run(tmp_path_factory):
    """A tiny GPT-2 trained 4 steps under FSDP on 2 ranks, checkpointed (shards) and exported as hf."""
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    run = tmp_path_factory.mktemp("export") / "hf-fsdp"
    run_ddpkit(
        *("train", HF, "--strategy", "fsdp", "--nproc", "2", "--batch-size", "8", "--epochs", "1", "--seed", "7"),
        *("--save-every", "1", "--threads", "1", "--quiet", "--export", "hf", "--run-dir", str(run), *HF_TINY),
    )
    return run


def test_a_ddp_run_exports_its_model_pt_or_a_named_checkpoint_split_by_size(reference_run, tmp_path, capsys):
    run = reference_run("--nproc", "2", "--seed", "5", "--save-every", "2", "--epochs", "6", "--quiet")
    out = _export(capsys, run, "--out", tmp_path / "final", "--max-shard-size", "1KB")
    assert f"exporting {run / 'model.pt'}" in out  # a finished run: its final weights
    state, files = _weights(tmp_path / "final")
    assert len(files) > 2
    assert_state_equal(state, load_model(run))
    _export(capsys, run, "--out", tmp_path / "e4", "--checkpoint", "epoch-000004")
    saved = torch.load(run / "checkpoints" / "epoch-000004.pt", weights_only=True)["model"]
    state, files = _weights(tmp_path / "e4")
    assert files == [] and not torch.equal(saved["0.weight"], load_model(run)["0.weight"])
    assert_state_equal(state, saved)


@pytest.mark.slow
def test_fsdp_shards_export_as_safetensors_equal_to_the_gathered_model(hf_fsdp_run, tmp_path, capsys):
    _export(capsys, hf_fsdp_run, "--checkpoint", "epoch-000001", "--out", tmp_path / "st")
    state, _ = _weights(tmp_path / "st")
    assert_state_equal(state, load_model(hf_fsdp_run))  # every name, the tied head as its own copy


@pytest.mark.slow
def test_hf_exports_load_with_from_pretrained_with_the_trained_weights(hf_fsdp_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "hf"
    _export(
        capsys,
        hf_fsdp_run,
        "--format",
        "hf",
        "--checkpoint",
        "epoch-000001",
        "--out",
        sharded,
        "--max-shard-size",
        "40KB",
    )
    trained = load_model(hf_fsdp_run)
    for folder, n_files in ((hf_fsdp_run / "export", 0), (sharded, 4)):  # train --export hf: from model.pt
        state, files = _weights(folder)
        assert len(files) == n_files and "lm_head.weight" not in state  # HF ties it again when loading
        assert (folder / "config.json").is_file() and (folder / "generation_config.json").is_file()
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert type(model).__name__ == "GPT2LMHeadModel" and model.lm_head.weight is model.transformer.wte.weight
        assert_state_equal(model.state_dict(), trained)
