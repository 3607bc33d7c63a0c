"""The one writer of folders (checkpoint/file.py replace_folder): sharded checkpoints, exports and
a run's hf_config/ are swapped in whole; a failed swap leaves the old folder's files, not a mix."""

import os

import pytest

from ddpkit.checkpoint import file as ckpt_file
from ddpkit.checkpoint import hf_config


def folder(path, **files):
    path.mkdir()
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def test_a_new_folder_replaces_the_old_one_whole_and_nothing_is_left_beside_it(tmp_path):
    dst = folder(tmp_path / "out", a="old", only_old="x")
    ckpt_file.replace_folder(folder(tmp_path / ".out.partial", a="new", b="new"), dst)
    assert sorted(p.name for p in dst.iterdir()) == ["a", "b"] and (dst / "a").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_swap_that_fails_leaves_the_old_folder_aside_whole_and_never_a_mix(tmp_path, monkeypatch):
    dst = folder(tmp_path / "out", a="old", only_old="x")
    src = folder(tmp_path / ".out.partial", a="new")
    real = os.replace

    def second_rename_fails(a, b):
        if str(a) == str(src):
            raise OSError(28, "No space left on device")
        real(a, b)

    monkeypatch.setattr(os, "replace", second_rename_fails)
    with pytest.raises(OSError):
        ckpt_file.replace_folder(src, dst)
    assert not dst.exists()
    aside = tmp_path / ".out.old"
    assert sorted(p.name for p in aside.iterdir()) == ["a", "only_old"] and (aside / "a").read_text() == "old"


def test_hf_config_is_put_in_place_as_a_whole(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    folder(run / hf_config.HF_DIR, stale="1")
    hf_config.put(folder(tmp_path / "prepared", **{"config.json": "{}"}), run)
    assert [p.name for p in (run / hf_config.HF_DIR).iterdir()] == ["config.json"]
    assert sorted(p.name for p in run.iterdir()) == [hf_config.HF_DIR]
