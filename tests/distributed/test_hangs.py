"""Hangs injected for real: a rank that sleeps inside a step, one that skips an all-reduce,
one stuck in __getitem__. Without a rerun, every rank leaves its stacks and collectives in
RUN_DIR/hang and one summary names the rank, the collective and the line."""

import json
from pathlib import Path

import pytest

from conftest import run_ddpkit

pytestmark = pytest.mark.serial  # timeouts of 3 s: a busy machine must not fire them early

TASKS = Path(__file__).parent / "scripts" / "fault_tasks.py"
WINE = ["--nproc", "2", "--epochs", "40", "--batch-size", "16", "--seed", "2", "--quiet"]
WATCHDOG = ["--hang-timeout", "3", "--timeout", "60"]  # the watchdog fires long before the collective timeout


def line_of(text: str) -> int:
    return next(i for i, line in enumerate(TASKS.read_text().splitlines(), 1) if text in line)


def hang(tmp_path, task, *flags, **env):
    run = tmp_path / "run"
    proc = run_ddpkit(
        "train",
        f"{TASKS}:{task}",
        *WINE,
        "--run-dir",
        str(run),
        *flags,
        check=False,
        timeout=120,
        env={"FAULT_STEP": "7", "FAULT_RANK": "1", **env},
    )
    assert proc.returncode == 1, proc.stderr  # a hang is a failure, not a usage error
    return proc.stderr, run / "hang"


@pytest.mark.parametrize(
    "flags, first",
    [
        (WATCHDOG, "made no progress for"),  # caught by the watchdog
        (
            ["--timeout", "3", "--hang-timeout", "0"],
            "rank 0 waited 3 s (--timeout) for rank 1",
        ),  # by the collective timeout
    ],
)
def test_a_rank_sleeping_inside_a_step_is_named_with_its_line(tmp_path, flags, first):
    err, hang_dir = hang(tmp_path, "exits_midway", *flags, FAULT_HANG="1")
    sleep = f"scripts/fault_tasks.py:{line_of('time.sleep(600)')} in forward: time.sleep(600)"
    assert "ddpkit: hang report" in err and first in err, err
    last = err.strip().splitlines()[-1]  # the launcher's one line names the hang and where the reports are
    assert last.startswith("ddpkit: error: rank ") and f"are in {hang_dir}" in last, err
    assert "rank(s) 1 never arrived at all_reduce #" in err and f"rank 1 at {sleep}" in err, err
    assert "rank 0   [" in err and ("waiting in all_reduce #" in err or "timed out in all_reduce #" in err), err
    stack = (hang_dir / "rank-1.txt").read_text()  # faulthandler's dump of every thread
    assert f'fault_tasks.py", line {line_of("time.sleep(600)")} in forward' in stack, stack
    assert "Current thread" in stack and "Thread 0x" in stack  # all threads: the watchdog's and the stuck main thread
    assert (hang_dir / "rank-0.txt").exists() and (hang_dir / "summary.txt").read_text().strip() in err
    assert json.loads((hang_dir / "fr-rank-0.json").read_text())["pg_status"]  # torch's flight recorder, on gloo


def test_a_rank_that_skips_an_all_reduce_is_named_with_both_collectives(tmp_path):
    err, hang_dir = hang(tmp_path, "skips_all_reduce", *WATCHDOG)
    verdict = next(line for line in err.splitlines() if "verdict:" in line)
    skipped = f"scripts/fault_tasks.py:{line_of('ddpkit.all_sum(torch.ones(3))')} in forward"
    assert "ranks are in different collectives" in verdict and "the same sequence number" in verdict, err
    assert "rank(s) 0 in all_reduce #" in verdict and "(shape [3], float32, backend) at " + skipped in verdict, err
    seq0 = verdict.split("rank(s) 0 in all_reduce #")[1].split()[0]
    seq1 = verdict.split("rank(s) 1 in all_reduce #")[1].split()[0]
    assert seq0 == seq1, verdict  # the same collective number, different collectives: rank 1 skipped one
    # torch's flight recorder: rank 0's gloo all-reduce is enqueued, never completed
    assert "gloo:all_reduce" in err and "not completed" in err, err
    records = json.loads((hang_dir / "rank-1.json").read_text())["collectives"]
    assert records[-1]["state"] == "waiting" and records[-1]["seq"] == int(seq1)


def test_a_rank_stuck_in_getitem_is_named_with_its_line(tmp_path):
    err, hang_dir = hang(tmp_path, "stuck_in_getitem", *WATCHDOG)
    at = f"scripts/fault_tasks.py:{line_of('stuck reading this item')} in __getitem__"
    assert "rank 1   [" in err and "in no collective" in err and at in err, err
    assert "rank(s) 1 never arrived" in err, err
    assert "in __getitem__" in (hang_dir / "rank-1.txt").read_text()


def test_under_torchrun_rank_0_prints_the_summary_itself(tmp_path):
    import os
    import subprocess
    import sys

    from conftest import REPO

    run = tmp_path / "run"
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [
            str(torchrun),
            "--nproc-per-node",
            "2",
            "-m",
            "ddpkit",
            "train",
            f"{TASKS}:exits_midway",
            "--run-dir",
            str(run),
            *WINE[2:],
            *WATCHDOG,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO / "src"), "FAULT_STEP": "7", "FAULT_RANK": "1", "FAULT_HANG": "1"},
    )
    assert proc.returncode != 0
    assert proc.stderr.count("ddpkit: hang report") == 1, proc.stderr  # no ddpkit launcher: rank 0 prints it
    assert "rank(s) 1 never arrived" in proc.stderr and "made no progress for" in proc.stderr, proc.stderr
