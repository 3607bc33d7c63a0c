"""`ddpkit train` ends as the shell expects (0 done, 1 a failure, 2 a usage error, 130 after SIGINT,
143 after SIGTERM) and with one true line: a TERM in its first seconds, a backend or device that
needs a GPU on a machine without one, --debug-collectives (torch's check of every collective)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_ddpkit

SLOW_TO_IMPORT = """
import os, time
from pathlib import Path

from ddpkit.tasks.wine import build

Path(os.environ["IMPORTED"]).write_text("")  # the launcher is checking the task: no worker has started
time.sleep(120)


def task(config=None):
    return build(config)
"""

SLOW_TO_BUILD = """
import os, time
from pathlib import Path

from ddpkit.tasks.wine import build


def task(config=None):
    Path(os.environ["IMPORTED"]).write_text("")  # a worker builds the task: the run has its folder
    time.sleep(120)
    return build(config)
"""

RECORDS_DEBUG_LEVEL = """
import os
from pathlib import Path

import torch.distributed as dist

from ddpkit.tasks.wine import build


def task(config=None):
    Path(f"{os.environ['LEVEL_OUT']}.{dist.get_rank()}").write_text(str(dist.get_debug_level()))
    return build(config)
"""


@pytest.mark.parametrize("slow", [SLOW_TO_IMPORT, SLOW_TO_BUILD], ids=["checking-the-task", "building-it"])
def test_sigterm_in_the_first_seconds_says_so_exits_143_and_leaves_no_empty_run_directory(tmp_path, slow):
    """While the launcher checks the task (nothing written yet) and while the workers build it
    (the run's folder made, nothing in it worth keeping): the folder is gone either way."""
    (tmp_path / "slow.py").write_text(slow)
    marker = tmp_path / "imported"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "train", "slow.py:task", "--nproc", "2", "--epochs", "1"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO / "src"), "IMPORTED": str(marker)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        if slow is SLOW_TO_BUILD:
            assert any((tmp_path / "runs").iterdir())  # the run directory exists by now, still empty
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, (proc.returncode, err)
    said = (
        "ddpkit: stopped by SIGTERM"
        if slow is SLOW_TO_IMPORT
        # the launch had started its workers
        else (
            "ddpkit: error: stopped by SIGTERM; the workers were stopped before a checkpoint was written "
            "(--save-on-signal TERM saves one first)"
        )
    )
    assert err.strip().splitlines() == [said], err  # one line: not torch's agent's own log lines too
    assert not (tmp_path / "runs").exists()  # nothing was written: no empty folder is left behind


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize(
    "flags, line",
    [
        (["--backend", "nccl"], "--backend nccl needs a CUDA GPU and none is in use; use --backend gloo (or auto)"),
        (["--device", "cuda"], "--device cuda was asked for but no CUDA GPU is visible; use --device cpu (or auto)"),
    ],
)
def test_a_choice_that_needs_a_gpu_on_a_machine_without_one_is_one_line_before_any_worker(tmp_path, flags, line):
    proc = run_ddpkit("train", *flags, "--nproc", "2", "--epochs", "1", cwd=tmp_path, check=False, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [f"ddpkit: error: {line}"], proc.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_debug_collectives_is_in_force_in_every_worker_and_ddp_runs_under_it(tmp_path, start):
    """A forked worker kept torch's level of the launcher (off: the flag did nothing); a spawned one
    crashed in DDP's constructor (SIGSEGV on gloo)."""
    (tmp_path / "level.py").write_text(RECORDS_DEBUG_LEVEL)
    out = tmp_path / "level"
    run_ddpkit(
        "train", "level.py:task", "--nproc", "2", "--epochs", "2", "--debug-collectives", "--start-method", start,
        "--run-dir", str(tmp_path / "run"), "--quiet", cwd=tmp_path, env={"LEVEL_OUT": str(out)}, timeout=180,
    )  # fmt: skip
    assert [Path(f"{out}.{rank}").read_text() for rank in (0, 1)] == ["DebugLevel.DETAIL"] * 2
    assert (tmp_path / "run" / "model.pt").exists()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("where", ["one-worker pod", "one local process"])
def test_a_one_worker_run_stopped_by_its_signal_saves_and_exits_by_the_signal_convention(tmp_path, where):
    """A PyTorchJob of one worker: the operator sets RANK and WORLD_SIZE=1 and the pod runs
    `ddpkit train` itself, as that one worker. Evicted (SIGTERM), it saves and must exit 143, not 0:
    Kubernetes would record a success for a run that did not finish, and never start it again.
    `ddpkit train --nproc 1` (trained in the command's own process) ends on Ctrl-C as a launch of
    several local workers does: 130, and the same line saying what was saved."""
    run = tmp_path / "run"
    base = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "PET_NPROC_PER_NODE")}
    pod = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    sig, flags, env = (signal.SIGTERM, [], pod) if where == "one-worker pod" else (signal.SIGINT, ["--nproc", "1"], {})
    args = ["train", *flags, "--epochs", "500", "--save-every", "0", "--save-on-signal", "INT,TERM"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", *args, "--run-dir", str(run)],
        env={**base, "PYTHONPATH": str(REPO / "src"), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, (proc.returncode, out, err)
    summary = json.loads((run / "summary.json").read_text())
    step = summary["steps_done"]
    assert summary["stopped_early"] and summary["checkpoint_step"] == step, summary
    assert err.strip().splitlines()[-1] == (
        f"ddpkit: error: stopped by {sig.name} after saving a checkpoint at step {step}: "
        f"continue with --resume --run-dir {run}"
    ), err
    saved = [p.name for p in (run / "checkpoints").iterdir()]
    assert len(saved) == 1 and saved[0].endswith(".pt"), saved  # --save-every 0: the stop's own checkpoint
    assert "Traceback" not in err and not (run / "model.pt").exists(), err
