"""The run directory's mark: the newest world to claim it owns it; an older world finds out."""

import json
import os

from ddpkit.checkpoint.world_mark import MARK_FILE, WorldMark
from ddpkit.errors import DdpkitError, RunDirTaken


def test_a_world_keeps_the_folder_until_another_claims_it_and_then_says_who(tmp_path):
    first = WorldMark(tmp_path, True, 4, 2)
    first.claim()
    assert not first.lost() and not first.lost()
    assert json.loads((tmp_path / MARK_FILE).read_text())["world_size"] == 4
    second = WorldMark(tmp_path, True, 2, 1)
    second.claim()
    assert first.lost() and first.lost()  # and stays lost
    assert not second.lost()
    error = first.error("epoch 3, step 7")
    assert isinstance(error, RunDirTaken) and isinstance(error, DdpkitError)
    text = str(error)
    assert text.startswith(RunDirTaken.OPENING) and str(tmp_path) in text, text
    assert "a world of 2 process(es) on 1 node(s)" in text and "this world (4 process(es) on 2 node(s)" in text, text
    assert "stopped at epoch 3, step 7" in text and "--max-restarts" in text and "keep-alive" in text, text
    assert [p.name for p in tmp_path.iterdir()] == [MARK_FILE]  # no temporary file left


def test_its_own_mark_touched_or_removed_is_not_a_takeover(tmp_path):
    mark = WorldMark(tmp_path, True, 2, 1)
    mark.claim()
    path = tmp_path / MARK_FILE
    os.utime(path, ns=(1, 1))  # the same token, another mtime (a copy, a touch)
    assert not mark.lost()
    path.unlink()
    assert not mark.lost()


def test_only_rank_0_looks_at_the_file(tmp_path):
    rank1 = WorldMark(tmp_path, False, 2, 1)
    rank1.claim()
    assert not (tmp_path / MARK_FILE).exists()
    WorldMark(tmp_path, True, 2, 1).claim()
    assert not rank1.lost()  # it hears of a takeover through the step's agreement
    text = str(rank1.error("epoch 1, step 2"))
    assert text.startswith(RunDirTaken.OPENING) and "a world of 2 process(es) on 1 node(s)" in text, text
