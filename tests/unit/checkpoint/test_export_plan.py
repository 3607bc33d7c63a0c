"""ddpkit export on one process: the plan of the output files, the sizes, which weights a run
exports, the files written from both kinds of checkpoint (the real writers, one process),
and the refusals (one line, exit 2, nothing written). Several ranks, FSDP and a Hugging Face
model: tests/distributed/test_export.py."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from ddpkit import DdpkitError, DistEnv, RunConfig
from ddpkit.checkpoint import hf_config
from ddpkit.checkpoint.checkpointer import Checkpointer
from ddpkit.checkpoint.export import INDEX, export_run, file_names, find_source, plan_files
from ddpkit.checkpoint.file import atomic_save
from ddpkit.checkpoint.schema import Header
from ddpkit.checkpoint.sharded import save_dcp
from ddpkit.checkpoint.state import Position
from ddpkit.cli.commands import main
from ddpkit.config.faults import Faults
from ddpkit.config.values import parse_memory
from ddpkit.runtime import Runtime
from ddpkit.strategies import DdpStrategy


@pytest.fixture
def rt():
    with Runtime(DistEnv(), device="cpu", threads=1) as r:
        yield r


class Tied(nn.Module):
    """An embedding and an output layer sharing one weight, plus a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.arange(3.0))


def _model(seed=0):
    torch.manual_seed(seed)
    return Tied()


def _loaded(folder):
    """Every tensor of an export folder (one file, or the files its index names)."""
    if not (folder / INDEX).exists():
        return load_file(folder / "model.safetensors")
    index = json.loads((folder / INDEX).read_text())
    state = {}
    for name in sorted(set(index["weight_map"].values())):
        part = load_file(folder / name)
        assert {k for k, v in index["weight_map"].items() if v == name} == set(part)
        state.update(part)
    return state


def _assert_equal(state, model):
    want = model.state_dict()
    assert state.keys() == want.keys()
    for k in want:
        assert torch.equal(state[k], want[k]), k


@pytest.mark.parametrize(
    "sizes, limit, files",
    [
        ([("a", 4), ("b", 4), ("c", 10), ("d", 1), ("e", 1)], 8, [["a", "b"], ["c"], ["d", "e"]]),
        ([("a", 4), ("b", 4)], 8, [["a", "b"]]),  # exactly the limit: one file
        ([("a", 9), ("b", 9)], 8, [["a"], ["b"]]),  # larger than the limit: alone
        ([("a", 1), ("b", 8), ("c", 1)], 8, [["a"], ["b"], ["c"]]),
    ],
)
def test_the_file_plan_fills_each_file_up_to_the_limit_in_order(sizes, limit, files):
    assert plan_files(sizes, limit) == files


def test_file_names_and_sizes_are_hugging_faces():
    assert file_names(1) == ["model.safetensors"]
    assert file_names(2) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert [parse_memory(s, "--max-shard-size") for s in ("5GB", "500MB", "2GiB", "1.5KB", "4096")] == [
        5 * 10**9,
        5 * 10**8,
        2 * 2**30,
        1500,
        4096,
    ]
    with pytest.raises(DdpkitError, match="--max-shard-size must be a size such as"):
        parse_memory("5 parsecs", "--max-shard-size")


def test_a_sharded_checkpoint_is_written_file_by_file_equal_to_the_model(rt, tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    header = Header(Position(3), model_signature={k: list(v.shape) for k, v in model.state_dict().items()})
    save_dcp(tmp_path, header, model, opt, rt)
    out = export_run(tmp_path, "safetensors", tmp_path / "out", max_shard_size="200B")
    assert sorted(p.name for p in out.iterdir()) == sorted([INDEX, *file_names(4)])  # 240 + 144 + 24 + 240 + 12 bytes
    _assert_equal(_loaded(out), model)  # the tied weight under both names, each its own tensor
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


def test_the_newest_weights_are_exported_unless_a_checkpoint_is_named(rt, tmp_path):
    model, final = _model(0), _model(1)
    saver = Checkpointer(
        tmp_path,
        rt,
        DdpStrategy(rt),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        Faults(save_every=0, snapshot_every_steps=0),
        {},
    )
    saver.save(Position(1))
    assert find_source(tmp_path) == tmp_path / "checkpoints" / "epoch-000001.pt"
    atomic_save(final.state_dict(), tmp_path / "model.pt")  # a finished run writes model.pt after its last checkpoint
    assert find_source(tmp_path) == tmp_path / "model.pt"
    _assert_equal(_loaded(export_run(tmp_path, "safetensors", tmp_path / "a")), final)
    _assert_equal(_loaded(export_run(tmp_path, "safetensors", tmp_path / "b", checkpoint="epoch-000001")), model)
    with pytest.raises(DdpkitError, match=r"--checkpoint epoch-000009: no such checkpoint .*epoch-000001.pt, model.pt"):
        find_source(tmp_path, "epoch-000009")


def _cli_error(capsys, *args):
    assert main(["export", *map(str, args)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_bad_input_is_one_line_exit_2_and_writes_nothing(capsys, tmp_path):
    run = tmp_path / "run"
    assert "no such run directory" in _cli_error(capsys, run)
    run.mkdir()
    assert "no checkpoint and no model.pt" in _cli_error(capsys, run)
    atomic_save(_model().state_dict(), run / "model.pt")
    assert "--format must be one of safetensors, hf, got 'onnx'" in _cli_error(capsys, run, "--format", "onnx")
    assert "use --format safetensors" in _cli_error(capsys, run, "--format", "hf")  # not a transformers model
    (run / "export").mkdir()
    (run / "export" / "mine.txt").write_text("keep")
    assert "already exists and is not empty" in _cli_error(capsys, run)
    assert [p.name for p in (run / "export").iterdir()] == ["mine.txt"]
    assert sorted(p.name for p in run.iterdir()) == ["export", "model.pt"]  # no partial folder either
    assert main(["export", str(run), "--out", str(tmp_path / "empty")]) == 0
    assert "wrote" in capsys.readouterr().out


def test_of_tied_names_the_first_is_kept_when_the_model_declares_none():
    # a transformers model declares its tied names (_tied_weights_keys): tests/distributed/test_export.py
    assert hf_config.left_out(Tied()) == {"head.weight": "embed.weight"}
    assert not hf_config.is_hf_model(Tied())


def test_train_export_takes_a_known_format_only():
    assert RunConfig(export="hf").export == "hf"
    with pytest.raises(DdpkitError, match="--export must be one of safetensors, hf, got 'onnx'"):
        RunConfig(export="onnx")
