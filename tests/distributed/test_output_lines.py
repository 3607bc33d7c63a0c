"""What reaches the console under `ddpkit train`: whole lines only, a task's prints from rank 0
alone unless --verbose (then every rank's, prefixed), and a run's length in the unit it was
asked in (steps for --max-steps)."""

import re
from pathlib import Path

from conftest import run_ddpkit

TASK = str(Path(__file__).parent / "scripts" / "print_task.py") + ":build"
ARGS = ["--nproc", "2", "--epochs", "2", "--batch-size", "16", "--save-every", "0", "--progress", "lines"]
TASK_LINE = re.compile(r"^(\[rank1\]:)?task rank (\d) line (\d+) y{200}$")


def _task_lines(stdout: str) -> list[tuple[str, int]]:
    """(rank, line number) of each task line, checking that every line that mentions the task is whole."""
    out = []
    for line in stdout.splitlines():
        if "task rank" in line or "yyyy" in line:
            m = TASK_LINE.match(line)
            assert m, f"a line that is not whole: {line[:100]!r}...{line[-60:]!r}"
            assert bool(m.group(1)) == (m.group(2) == "1"), line[:40]  # rank 1's lines, and only they, are prefixed
            out.append((m.group(2), int(m.group(3))))
    return out


def test_only_rank_0s_prints_reach_the_console_and_whole(tmp_path):
    proc = run_ddpkit("train", TASK, *ARGS, "--run-dir", str(tmp_path / "r"))
    assert _task_lines(proc.stdout) == [("0", i) for i in range(200)]
    assert "epoch 2/2  train_loss" in proc.stdout and "ddpkit: run finished" in proc.stdout


def test_verbose_shows_every_ranks_prints_as_whole_prefixed_lines(tmp_path):
    proc = run_ddpkit("train", TASK, *ARGS, "--verbose", "--run-dir", str(tmp_path / "r"))
    lines = _task_lines(proc.stdout)
    assert sorted(lines) == sorted([(r, i) for r in "01" for i in range(200)])
    assert [i for r, i in lines if r == "1"] == list(range(200))  # each rank's in its order
    assert "epoch 2/2  train_loss" in proc.stdout and "ddpkit: run finished" in proc.stdout


def test_a_run_by_steps_reports_steps(tmp_path):
    # Wine: 5 optimizer steps per epoch at a global batch of 32; 12 steps end in epoch 3
    proc = run_ddpkit(
        "train",
        "--nproc",
        "2",
        "--batch-size",
        "16",
        "--max-steps",
        "12",
        "--save-every",
        "0",
        "--progress",
        "lines",
        "--run-dir",
        str(tmp_path / "r"),
    )
    assert "epoch 1/3  step  5/12  train_loss" in proc.stdout and "epoch 3/3  step 12/12  train_loss" in proc.stdout
    assert "global batch 32 (16 per process), steps 12/12, epoch 3\n" in proc.stdout
    assert "epochs 3/100" not in proc.stdout
