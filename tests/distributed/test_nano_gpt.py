"""A torchrun user's own GPT training script (scripts/nano_gpt.py: its own DDP, checkpoint and
resume; written for this test) runs the same under `ddpkit launch` as under torchrun, 2 workers:
every logged loss and the checkpoint, bit for bit. Through a restart (a rank killed, --max-restarts
1) the script resumes itself from its checkpoint and ends as the uninterrupted run. (torchrun's
own restart does not reconnect on this torch: the restarted run is compared with ddpkit's.)"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_ddpkit

SCRIPT = str(Path(__file__).parent / "scripts" / "nano_gpt.py")
# one thread per worker under both launchers (torchrun's default): the same CPU kernels, the same bits
FLAGS = ["--standalone", "--nproc_per_node=2"]


def settings(folder: Path, *extra: str) -> list[str]:
    return [f"--out_dir={folder / 'out'}", f"--loss_log={folder / 'losses.txt'}", "--max_iters=30", *extra]


def losses(folder: Path) -> dict[int, str]:
    """Each iteration's loss (float.hex), the last logged for it (a restarted run logs some twice)."""
    found = {}
    for line in (folder / "losses.txt").read_text().splitlines():
        _, iteration, _, value = line.split()
        found[int(iteration)] = value
    return found


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("nano-launch")
    run_ddpkit("launch", *FLAGS, "--threads", "1", SCRIPT, *settings(folder), cwd=folder, timeout=300)
    return folder


def test_every_loss_and_the_checkpoint_are_the_same_as_under_torchrun(launched, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *FLAGS, SCRIPT, *settings(tmp_path)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    ours, theirs = ((folder / "losses.txt").read_text().splitlines() for folder in (launched, tmp_path))
    assert len(ours) == 30 and ours == theirs  # each iteration once, the same bits
    first, last = (float.fromhex(ours[i].split()[-1]) for i in (0, -1))
    assert last < 0.8 * first  # it learns: a real run, not a constant
    assert (launched / "out" / "ckpt.pt").read_bytes() == (tmp_path / "out" / "ckpt.pt").read_bytes()


def test_a_killed_rank_restarts_and_the_script_resumes_itself_to_the_uninterrupted_result(launched, tmp_path):
    proc = run_ddpkit(
        "launch", *FLAGS, "--threads", "1", "--max-restarts", "1", SCRIPT, *settings(tmp_path, "--die_at=15"),
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert "ddpkit: worker rank 1 was killed by signal 9; restarting the workers, attempt 2 of 2" in proc.stderr
    logged = (tmp_path / "losses.txt").read_text().splitlines()
    assert len(logged) > 30 and logged.count(logged[10]) == 2  # iterations from the checkpoint at 10 ran twice
    assert losses(tmp_path) == losses(launched)
    assert (tmp_path / "out" / "ckpt.pt").read_bytes() == (launched / "out" / "ckpt.pt").read_bytes()
