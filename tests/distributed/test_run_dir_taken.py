"""Two worlds of one job training into one run directory (an elastic rendezvous that dropped an
overloaded node): the older world must stop at a step, say why, and leave the folder to the
newer one (checkpoint/world_mark.py). Shown with two jobs on one machine: the second resumes
the first's run directory (--auto-resume) while the first still trains."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.conftest import REPO, load_model, run_ddpkit

from ddpkit.errors import RunDirTaken

pytestmark = pytest.mark.serial  # the paced first run must still be training when the second takes over: no other load

TASK = str(Path(__file__).parent / "scripts" / "paced_wine.py") + ":build"
# 142 samples, 16 a step at any world size: 9 steps an epoch; paced at 250 ms a step the first run alone would
# train ~22 s (time enough for the second to start on a loaded machine), the second (not paced) ~1 s
TRAIN = (TASK, "--epochs", "10", "--batch-size", "8", "--global-batch-size", "16", "--save-every", "0")
TRAIN += ("--save-every-steps", "3", "--quiet")


@pytest.mark.slow  # 13-17 s on a quiet machine, up to ~35 s at load 5 on 2 cores
def test_an_older_world_stops_when_a_newer_one_takes_its_run_directory_and_leaves_the_end_to_it(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "PACED_WINE_STEP_S": "0.25"}
    argv = [sys.executable, "-m", "ddpkit", "train", *TRAIN, "--nproc", "2", "--run-dir", str(run)]
    first = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not list(run.glob("checkpoints/epoch-*.pt")):  # its first checkpoint: the second resumes it
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read() if first.poll() else ""
            time.sleep(0.05)
        run_ddpkit("train", *TRAIN, "--nproc", "1", "--auto-resume", "--run-dir", str(run))
        out, _ = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 2, out
    assert RunDirTaken.OPENING in out and "a world of 1 process(es) on 1 node(s)" in out, out
    assert "--max-restarts" in out and "Traceback" not in out, out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["epochs_done"] == 10, summary  # the second's, not the first's
    assert json.loads((run / ".world").read_text())["world_size"] == 1 and not (run / "failed.json").exists()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [9 * e for e in range(1, 11)], steps  # one line per epoch: the second's, none of the first's after
    assert load_model(run).keys()  # the second's model.pt, whole
