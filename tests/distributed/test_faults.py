"""Faults injected for real (SIGKILL from outside, os._exit from inside, SIGINT, killed
while saving, corrupt files, NaN): ddpkit recovers, or stops with a clear message, and loses
nothing since the last checkpoint."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, assert_state_equal, load_model, run_ddpkit

TASKS = str(Path(__file__).parent / "scripts" / "fault_tasks.py")
WINE = ["--epochs", "40", "--batch-size", "16", "--seed", "2", "--save-every", "5"]


def _start(*args, cwd=None, env=None):
    return subprocess.Popen(
        [sys.executable, "-m", "ddpkit", *args],
        cwd=cwd,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "src"), **(env or {})},
    )


def _children(pid):
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _wait_for_lines(path, n, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while not (path.exists() and len(path.read_text().splitlines()) >= n):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "training did not get far enough"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("ref") / "run"
    run_ddpkit("train", "--nproc", "2", "--quiet", "--run-dir", str(run), *WINE)
    return run


@pytest.fixture(scope="module")
def reference200(tmp_path_factory):
    run = tmp_path_factory.mktemp("ref200") / "run"
    run_ddpkit("train", "--nproc", "2", "--quiet", "--run-dir", str(run), *WINE, "--epochs", "200")
    return run


def test_worker_killed_from_outside_is_restarted_and_the_run_ends_bit_identical(tmp_path, reference200):
    run = tmp_path / "run"
    proc = _start(
        "train",
        "--nproc",
        "2",
        "--max-restarts",
        "2",
        "--run-dir",
        str(run),
        *WINE,
        "--epochs",
        "200",
        "--save-every",
        "5",
    )
    try:
        _wait_for_lines(run / "metrics.jsonl", 12, proc)
        workers = _children(proc.pid)
        assert len(workers) >= 2, workers
        os.kill(workers[-1], signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    assert "resuming from" in out
    assert_state_equal(load_model(run), load_model(reference200))
    epochs = [json.loads(x)["epoch"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert epochs == list(range(1, 201))  # every epoch logged once, none lost


@pytest.mark.parametrize("nproc", [1, 2])
def test_worker_exiting_from_inside_is_restarted_and_the_run_ends_bit_identical(tmp_path, reference, nproc):
    run = tmp_path / "run"
    env = {"FAULT_STEP": "52", "FAULT_RANK": str(nproc - 1)}  # the 52nd step: mid-epoch 11 (5 steps an epoch)
    proc = run_ddpkit(
        "train",
        f"{TASKS}:exits_midway",
        "--nproc",
        str(nproc),
        "--max-restarts",
        "1",
        "--run-dir",
        str(run),
        *WINE,
        "--batch-size",
        str(32 // nproc),
        env=env,
    )
    assert "resuming from" in proc.stdout
    if nproc == 2:
        assert_state_equal(load_model(run), load_model(reference))
    else:
        ref = tmp_path / "ref1"
        run_ddpkit("train", "--nproc", "1", "--quiet", "--run-dir", str(ref), *WINE, "--batch-size", "32")
        assert_state_equal(load_model(run), load_model(ref))


def test_without_restarts_a_dying_worker_ends_the_job_and_names_the_rank(tmp_path):
    proc = run_ddpkit(
        "train",
        f"{TASKS}:exits_midway",
        "--nproc",
        "2",
        "--run-dir",
        str(tmp_path / "r"),
        *WINE,
        env={"FAULT_STEP": "7", "FAULT_RANK": "1"},
        check=False,
    )
    assert proc.returncode == 1  # a worker's failure, not a usage error
    assert "ddpkit: error: worker rank 1 exited with code 3" in proc.stderr


def test_after_a_restart_the_failure_named_is_the_last_attempts_not_an_earlier_error(tmp_path):
    proc = run_ddpkit(
        "train", f"{TASKS}:refuses_then_dies", "--nproc", "2", "--max-restarts", "1", "--quiet",
        "--run-dir", str(tmp_path / "run"), env={"FAULT_RANK": "1"}, check=False, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ddpkit: error: worker rank 1 exited with code 3"), proc.stderr  # attempt 1's failure
    assert "refused on the first attempt" not in last


@pytest.mark.serial  # --timeout 3: the healthy rank's set-up must not be slowed past it
@pytest.mark.parametrize(
    "grad_sync, fragment",
    [
        ("auto", "rank 0 waited 3 s (--timeout) for rank 1 to reach the same all-reduce"),  # shared-memory barrier
        ("backend", "timed out"),  # gloo's own timeout
    ],
)
def test_a_hanging_worker_ends_the_job_after_the_timeout(tmp_path, grad_sync, fragment):
    proc = run_ddpkit(
        "train",
        f"{TASKS}:exits_midway",
        "--nproc",
        "2",
        "--run-dir",
        str(tmp_path / "r"),
        *WINE,
        "--timeout",
        "3",
        "--grad-sync",
        grad_sync,
        env={"FAULT_STEP": "7", "FAULT_RANK": "1", "FAULT_HANG": "1"},
        check=False,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr  # a hang is a failure, not a usage error
    assert fragment in proc.stderr.lower() if fragment == "timed out" else fragment in proc.stderr, proc.stderr


def test_ctrl_c_with_save_on_signal_checkpoints_and_resume_ends_bit_identical(tmp_path, reference200):
    run = tmp_path / "run"
    args = ["--nproc", "2", "--run-dir", str(run), *WINE, "--epochs", "200"]
    proc = _start("train", *args, "--save-on-signal", "INT,TERM")
    try:
        _wait_for_lines(run / "metrics.jsonl", 12, proc)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: the launcher and every worker
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err  # the shell's code after SIGINT
    last = err.strip().splitlines()[-1]  # what was saved, and how to continue: true for this command
    assert last.startswith(
        "ddpkit: error: stopped by SIGINT; the workers were stopped after saving a checkpoint at step "
    )
    assert last.endswith(f": continue with --resume --run-dir {run}"), last
    assert "Traceback" not in err, err  # the workers stopped cleanly after saving
    assert not (run / "model.pt").exists()
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert saved and not any(n.endswith(".tmp") for n in saved)
    run_ddpkit("train", *args, "--resume", "--quiet")
    assert_state_equal(load_model(run), load_model(reference200))


def test_killed_while_saving_leaves_the_previous_checkpoint_in_use(tmp_path):
    run = tmp_path / "run"
    args = [
        "train",
        f"{TASKS}:big",
        "--nproc",
        "1",
        "--epochs",
        "50",
        "--batch-size",
        "64",
        "--save-every",
        "1",
        "--run-dir",
        str(run),
        "--quiet",
    ]
    proc = _start(*args)
    ckpts = run / "checkpoints"
    deadline = time.monotonic() + 120
    try:
        while True:  # wait for a complete checkpoint and the next one half written
            names = [p.name for p in ckpts.iterdir()] if ckpts.exists() else []
            if any(n.endswith(".tmp") for n in names) and any(n.endswith(".pt") for n in names):
                os.killpg(proc.pid, signal.SIGKILL)
                break
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.005)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    complete = sorted(p.name for p in ckpts.iterdir() if p.name.endswith(".pt"))
    assert any(p.name.endswith(".tmp") for p in ckpts.iterdir())  # the half-written file is there...
    resumed = run_ddpkit(*args[:-1], "--resume", "--epochs", str(int(complete[-1][6:12]) + 1))
    assert f"resuming from {ckpts / complete[-1]}" in resumed.stdout  # ...and is never loaded
    assert (run / "model.pt").exists()
    assert not [p.name for p in ckpts.iterdir() if p.name.endswith(".tmp")]  # and removed at the start


def test_corrupt_newest_checkpoint_is_reported_and_the_newest_valid_one_used(tmp_path, reference):
    run = tmp_path / "run"
    args = ["train", "--nproc", "2", "--run-dir", str(run), *WINE]
    run_ddpkit(*args, "--epochs", "20", "--quiet")
    newest = run / "checkpoints" / "epoch-000020.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated
    proc = run_ddpkit(*args, "--resume")
    assert "skipping checkpoint" in proc.stdout and "epoch-000020.pt" in proc.stdout and "truncated" in proc.stdout
    assert "epoch-000015.pt" in proc.stdout
    assert_state_equal(load_model(run), load_model(reference))


def test_a_checkpoint_altered_to_hold_nan_weights_is_skipped_though_its_checksums_match(tmp_path, reference):
    """CRC-32 is accident protection: whoever rewrites a checkpoint rewrites its checksums too.
    NaN weights are never saved (the save checks), so a checkpoint holding them was altered."""
    from ddpkit.checkpoint import file as ck

    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    for name in ("epoch-000030.pt", "epoch-000035.pt"):
        shutil.copy(reference / "checkpoints" / name, ckpts / name)
    altered = torch.load(ckpts / "epoch-000035.pt", weights_only=True)
    next(iter(altered["model"].values())).view(-1)[0] = float("nan")
    ck.atomic_save(altered, ckpts / "epoch-000035.pt")  # its CRC-32s recomputed
    proc = run_ddpkit("train", "--nproc", "2", "--run-dir", str(tmp_path / "run"), *WINE, "--resume")
    skips = [line for line in proc.stdout.splitlines() if "skipping checkpoint" in line]
    assert len(skips) == 1 and "epoch-000035.pt" in skips[0] and "NaN/inf" in skips[0], proc.stdout
    assert f"resuming from {ckpts / 'epoch-000030.pt'}" in proc.stdout
    assert_state_equal(load_model(tmp_path / "run"), load_model(reference))


# fused: Adam's fused kernel takes found_inf, so the device skips the step and the host reads the
# agreement a step later (training/step.py); not fused: the host decides at once
FUSED = pytest.mark.parametrize("fused", [[], ["--fused-optimizer", "on"]], ids=["host decides", "device decides"])


def test_nan_loss_stops_with_epoch_and_step_and_no_nan_checkpoint(tmp_path):
    errors = []
    for name, fused in (("host", []), ("device", ["--fused-optimizer", "on"])):
        run = tmp_path / name
        proc = run_ddpkit(
            "train", f"{TASKS}:nan_sample", "--nproc", "2", "--run-dir", str(run), *WINE, *fused, check=False
        )  # fmt: skip
        assert proc.returncode == 2
        assert "not finite in epoch 1, step" in proc.stderr and "no checkpoint was written" in proc.stderr
        assert "holds finite weights" not in proc.stderr  # there is none to hold them
        assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
        errors.append([line for line in proc.stderr.splitlines() if "not finite" in line])
    assert errors[0] == errors[1] and len(errors[0]) == 1, errors  # the device's decision names the same step


@FUSED
def test_nan_loss_with_skip_drops_those_steps_on_every_rank(tmp_path, fused):
    run = tmp_path / "run"
    run_ddpkit(
        "train", f"{TASKS}:nan_sample", "--nproc", "2", "--run-dir", str(run), *WINE, "--on-nan", "skip", "--quiet",
        *fused,
    )  # fmt: skip
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["skipped_steps"] == 1 for r in lines)  # the step holding the NaN sample, each epoch
    state = load_model(run)
    assert all(torch.isfinite(v).all() for v in state.values())
    assert lines[-1]["eval_accuracy"] > 0.9
