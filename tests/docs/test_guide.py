"""docs/guide.md cannot rot: its blocks are executed, in order, in one scratch folder.

The markers above its blocks say how each is checked (tests/docs/docblocks.py, which
test_pages.py applies to every other page): a ```bash block runs, `<!-- expect: REGEX -->`
must match its output, `<!-- needs: COMMAND --FLAG -->` names what of the CLI it uses,
`<!-- file: NAME -->` writes a block for later ones, `<!-- diff: BEFORE AFTER -->` must be the
diff of two files of the repository, `<!-- output -->` is what a command printed.
Commands run as written: the guide's epoch counts are small enough. Blocks depend on the
ones before them (runs/ fills up), so select them with -k only together with those.
"""

from __future__ import annotations

import runpy
import sys

import pytest
from docblocks import REPO, check_block, missing_features, parse_page, python_shims

GUIDE = REPO / "docs" / "guide.md"
BLOCKS = parse_page(GUIDE.read_text(), GUIDE)


@pytest.fixture(scope="module")
def guide_dir(tmp_path_factory):
    """The scratch folder every block runs in, with the repository's examples/ and this
    checkout's ddpkit, python and torchrun first on PATH."""
    root = tmp_path_factory.mktemp("guide")
    return root, python_shims(root)


def test_a_command_or_flag_the_cli_lacks_is_named():
    assert missing_features("check") == []
    assert missing_features("train --nproc --resume") == []
    assert missing_features("train --nproc --no-such-flag") == ["ddpkit train --no-such-flag"]
    assert missing_features("no-such-command --x") == ["ddpkit no-such-command"]


def test_the_guide_walks_the_whole_path():
    """At least the path's commands, each run by a block."""
    commands = "".join(b.text for b in BLOCKS if b.kind == "run")
    for needed in (
        "ddpkit env",
        "ddpkit train --nproc 1",
        "ddpkit train --nproc 2",
        "ddpkit plot",
        "--resume",
        "ddpkit launch",
        "torchrun",
        "ddpkit plan",
        "--strategy fsdp",
        "ddpkit slurm",
    ):
        assert needed in commands, needed


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_guide_block(block, guide_dir):
    root, env = guide_dir
    check_block(block, root, env)


def test_the_script_before_conversion_runs_as_the_guide_says(tmp_path, monkeypatch, capsys):
    """examples/convert/train_single.py is only shown in the guide (as the diff's left side)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train_single.py", "3", "2"])
    runpy.run_path(str(REPO / "examples" / "convert" / "train_single.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "Epoch 2, Loss:" in out
    assert sorted(p.name for p in tmp_path.glob("model_*.pt")) == [
        "model_0.pt",
        "model_2.pt",
    ]  # its habit: one at epoch 0
