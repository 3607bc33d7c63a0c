"""Two worlds of an own loop saving into one folder (two jobs, or an elastic job split in two)
never silently overwrite each other's checkpoints: the newest world to save there owns the folder,
and an older one's next rt.save is refused on every rank, as `ddpkit train`'s run directory
(tests/distributed/test_run_dir_taken.py)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from conftest import REPO, run_ddpkit

SCRIPT = str(Path(__file__).parent / "scripts" / "saves_twice.py")


def test_an_older_world_never_overwrites_the_newer_worlds_checkpoint(tmp_path):
    folder = tmp_path / "ckpts"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    first = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "launch", "--nproc", "2", SCRIPT, str(folder), "A", "2", str(tmp_path / "go")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (folder / "A-1").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        # a second job saves into the same folder while the first is between its saves
        run_ddpkit("launch", "--nproc", "2", SCRIPT, str(folder), "B", "1", "-", timeout=120)
    finally:
        (tmp_path / "go").touch()
        out, err = first.communicate(timeout=120)
    assert first.returncode != 0
    assert "another world took over the run directory" in err and "refused rt.save(" in err, err
    assert torch.load(folder / "ckpt.pt", weights_only=True)["extra"]["who"] == "B-1"  # not replaced by A's second
    assert not (folder / "A-2").exists()
