"""`ddpkit runs` asks whether a run can be resumed without a model to load into: the newest
checkpoint whose header loads, passing over newer ones that do not (as resume does)."""

import torch

from ddpkit.checkpoint import Position, atomic_save
from ddpkit.checkpoint.file import checkpoint_path
from ddpkit.checkpoint.headers import newest_header
from ddpkit.checkpoint.schema import Header


def test_the_newest_loadable_header_is_found_and_broken_ones_passed_over(tmp_path):
    assert newest_header(tmp_path) is None
    header = Header(Position(epoch=2, samples=64, global_step=12, global_batch=32), world_size=3)
    atomic_save({**header.to_dict(), "model": {"w": torch.ones(2)}}, checkpoint_path(tmp_path, 2, 0))
    checkpoint_path(tmp_path, 3, 0).write_bytes(b"half a checkpoint")  # newer, cut short
    atomic_save({"w": torch.ones(2)}, checkpoint_path(tmp_path, 4, 0))  # a plain state_dict, no header
    path, found = newest_header(tmp_path)
    assert path == checkpoint_path(tmp_path, 2, 0)
    pos = found.position
    assert (found.world_size, pos.epoch, pos.samples, pos.global_step) == (3, 2, 64, 12)
