"""A full disk and a read-only run directory, on real (tiny / read-only) tmpfs mounts."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_ddpkit


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


TASKS = str(Path(__file__).parent / "scripts" / "fault_tasks.py")
SEVEN_MB = (f"{TASKS}:seven_mb", "--nproc", "2", "--batch-size", "16", "--seed", "1", "--quiet")


def _leftovers(run):
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("kind", [(), ("--async-save",), ("--strategy", "fsdp")], ids=["ddp", "async", "fsdp"])
def test_a_full_disk_is_one_line_for_every_kind_of_save_and_resume_works_once_space_is_back(tmpfs, kind, tmp_path):
    disk = tmpfs(20 * 1024)  # two ~7 MB checkpoints fit, the third does not
    run = disk / "run"
    args = ("train", *SEVEN_MB, *kind, "--save-every", "1", "--run-dir", str(run))
    proc = run_ddpkit(*args, "--epochs", "6", check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ddpkit: error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "epoch-000003" in errors[0] and "No space left on device" in errors[0], errors[0]
    assert _leftovers(run) == []  # the partial write is gone (FSDP's .partial folder too)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) in (
        ["epoch-000001.pt", "epoch-000002.pt"],
        ["epoch-000001", "epoch-000002"],
    )
    subprocess.run(["mount", "-o", "remount,size=60m", str(disk)], check=True)  # space is back
    run_ddpkit(*args, "--epochs", "4", "--resume")
    epochs = [json.loads(line)["epoch"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [1, 2, 3, 4] and (run / "model.pt").exists()  # epochs 3-4 trained from epoch 2's checkpoint


def test_a_full_export_target_is_one_line_and_leaves_nothing(tmpfs, reference_run):
    run = reference_run(*SEVEN_MB, "--epochs", "1")
    disk = tmpfs(4 * 1024)  # smaller than the model
    proc = run_ddpkit("export", str(run), "--out", str(disk / "out"), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("ddpkit: error: cannot write")
    assert "No space left on device" in proc.stderr and list(disk.iterdir()) == []


def test_a_full_dev_shm_stops_the_snapshots_with_one_line_and_the_run_goes_on(tmp_path):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to give the run a small /dev/shm of its own")
    run = tmp_path / "run"
    train = [sys.executable, "-m", "ddpkit", "train", *SEVEN_MB, "--epochs", "3", "--max-restarts", "1"]
    train += ["--snapshot-every-steps", "1", "--grad-sync", "backend", "--run-dir", str(run)]
    script = f"mount -t tmpfs -o size=10m tmpfs /dev/shm && exec {' '.join(train)}"
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stdout.splitlines() if "cannot keep snapshots" in line]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], proc.stdout
    assert (run / "model.pt").exists() and "Traceback" not in proc.stderr
