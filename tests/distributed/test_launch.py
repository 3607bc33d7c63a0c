"""`ddpkit launch`: any script on N workers, with torchrun's environment; exact evaluation."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import OWN_LOOP, OWN_LOOP_EPOCHS, REPO, assert_state_equal, run_ddpkit

HERE = Path(__file__).parent / "scripts"


def test_evaluation_counts_every_sample_once_at_any_world_size(tmp_path):
    """36 test samples over 1, 2, 3 and 5 ranks: a DistributedSampler would pad 36 to 38 or 40."""
    results = {}
    for world in (1, 2, 3, 5):
        out = tmp_path / f"eval{world}.json"
        if world == 1:  # one process needs no launcher: run the same script in-process
            subprocess.run(
                [sys.executable, str(HERE / "eval_exact.py"), str(out)],
                check=True,
                timeout=120,
                env={**__import__("os").environ, "PYTHONPATH": str(REPO / "src")},
            )
        else:
            run_ddpkit("launch", "--nproc", str(world), str(HERE / "eval_exact.py"), str(out))
        results[world] = json.loads(out.read_text())
    base = results[1]
    assert base["eval_accuracy"] * 36 == pytest.approx(round(base["eval_accuracy"] * 36))
    for world, res in results.items():
        assert res["eval_accuracy"] == base["eval_accuracy"], (world, res)
        assert res["eval_loss"] == pytest.approx(base["eval_loss"], rel=1e-6), (world, res)  # float32 batch means


def test_own_loop_script_runs_the_same_under_ddpkit_launch_and_plain_torchrun(tmp_path, own_loop_launched):
    stdout, a = own_loop_launched  # ddpkit launch --nproc 2 OWN_LOOP --epochs 3
    assert "epoch 3: loss" in stdout and "(world size 2)" in stdout
    assert stdout.count("epoch 3: loss") == 1  # rank 0 prints, rank 1 is silent
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",  # a free port of its own: torchrun's default (29500) is shared by parallel tests
            "--nproc-per-node",
            "2",
            OWN_LOOP,
            "--epochs",
            OWN_LOOP_EPOCHS,
            "--out",
            str(tmp_path / "b"),
        ],
        check=True,
        capture_output=True,
        timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO / "src")},
    )
    b = torch.load(tmp_path / "b" / "final.pt", weights_only=True)
    assert a["extra"] == {"epochs": 3}
    assert_state_equal(a["model"], b["model"])


@pytest.mark.serial  # the script's collectives time out after 5 s: no other load
def test_a_collective_no_other_rank_reaches_ends_the_job_instead_of_hanging(tmp_path):
    # rank 0 waits for ever: if the collective's timeout did not end the job, the subprocess
    # timeout would fail this test
    script = HERE / "collective_mismatch.py"
    proc = run_ddpkit("launch", "--nproc", "2", str(script), check=False, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1  # a failed worker: torchrun's exit code
    assert "Timed out waiting 5000ms" in proc.stderr  # gloo's own words: the 5 s of ddpkit.init(timeout=5)
    # the rank that never arrived is named, not rank 1, which waited in the all-reduce
    sleep = next(i for i, line in enumerate(script.read_text().splitlines(), 1) if "time.sleep(0.2)" in line)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ddpkit: error: rank 0 hung at scripts/collective_mismatch.py:{sleep} in <module>"), last
    assert "it never reached gloo:all_reduce #1, in which rank 1 waited" in last, last


def test_launch_refuses_a_missing_script(tmp_path):
    proc = run_ddpkit("launch", "--nproc", "2", str(tmp_path / "nope.py"), check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
