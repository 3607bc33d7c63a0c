"""A launch whose workers all exit without ever joining a process group (a script that checks
for GPUs and quits) says so in one warning line; its exit code stays the script's."""

from pathlib import Path

import pytest

from conftest import run_ddpkit

HERE = Path(__file__).parent / "scripts"


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("ddpkit: warning:")]


@pytest.mark.parametrize("after", ["0", "1.5"])  # at once; after a while (the workers' environment was read)
def test_workers_that_quit_before_joining_get_one_warning_and_exit_0(after):
    proc = run_ddpkit("launch", "--nproc", "2", str(HERE / "quits_without_gpus.py"), env={"QUIT_AFTER": after})
    assert proc.returncode == 0
    assert proc.stdout.count("this example needs CUDA GPUs; exiting") == 2
    warnings = _warnings(proc.stderr)
    assert len(warnings) == 1, proc.stderr
    assert "the 2 workers all exited without ever joining a process group" in warnings[0]
    assert "checked for GPUs" in warnings[0]


def test_workers_that_joined_get_no_warning():
    proc = run_ddpkit("launch", "--nproc", "2", str(HERE / "joins_and_leaves.py"))
    assert proc.returncode == 0 and _warnings(proc.stderr) == [], proc.stderr


def test_a_single_process_launch_is_not_warned_about():
    proc = run_ddpkit("launch", "--nproc", "1", str(HERE / "quits_without_gpus.py"))
    assert proc.returncode == 0 and _warnings(proc.stderr) == [], proc.stderr
