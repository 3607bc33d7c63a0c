"""A full disk and a read-only run directory, on real (tiny / read-only) tmpfs mounts."""

import os
import subprocess

import pytest
import torch

from conftest import run_ddpkit


@pytest.fixture
def tmpfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs (CI runs as root)")
    mounts = []

    def mount(size_kb, readonly=False):
        point = tmp_path / f"mnt{len(mounts)}"
        point.mkdir()
        opts = f"size={size_kb}k" + (",ro" if readonly else "")
        subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(point)], check=True)
        mounts.append(point)
        return point

    yield mount
    for point in mounts:
        subprocess.run(["umount", "-l", str(point)], check=False)


def test_disk_full_at_a_checkpoint_is_a_clear_error_and_the_previous_one_survives(tmpfs):
    disk = tmpfs(100)  # room for one Wine checkpoint (~48 kB) but not two
    run = disk / "run"
    proc = run_ddpkit(
        "train", "--nproc", "2", "--epochs", "20", "--save-every", "2", "--run-dir", str(run), "--quiet", check=False
    )
    assert proc.returncode == 2
    assert "No space left on device" in proc.stderr and "previous checkpoint is intact" in proc.stderr
    assert "Traceback" not in proc.stderr
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["epoch-000002.pt"]  # no partial file next to it
    ckpt = torch.load(run / "checkpoints" / names[0], weights_only=True)
    assert ckpt["epoch"] == 2


def test_read_only_run_directory_is_refused_before_training(tmpfs):
    disk = tmpfs(64, readonly=True)
    proc = run_ddpkit("train", "--epochs", "1", "--run-dir", str(disk / "run"), check=False)
    assert proc.returncode == 2
    assert "cannot write to run directory" in proc.stderr and "Read-only file system" in proc.stderr
