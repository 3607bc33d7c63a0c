"""Preemption never loses a step, on the real 2-node SLURM of the fixture: a time limit's warning
signal, a second signal while the checkpoint is being written, `scontrol requeue` from outside and
a job array. Every job runs the script `ddpkit slurm` writes, with `scontrol` refused inside the job
step (as in a container: the batch script requeues from the batch host), and ends at the model of
an uninterrupted run bit for bit (1 process per node, gloo, 1 thread: the same arithmetic)."""

import json
import os
import time

import pytest

from conftest import REPO, assert_state_equal, load_model, run_ddpkit

pytestmark = [pytest.mark.cluster, pytest.mark.slow]  # each 35-50 s

TASK = str(REPO / "tests" / "cluster" / "scripts" / "preempted_wine.py") + ":build"
TRAIN = ["--epochs", "40", "--batch-size", "16", "--seed", "9", "--save-every", "0", "--eval-every", "20"]
TRAIN += ["--threads", "1"]
REQUEUED = "ddpkit: requeueing SLURM job"


@pytest.fixture
def reference(reference_run):
    return reference_run("wine", "--nproc", "2", "--quiet", "--grad-sync", "backend", *TRAIN)


@pytest.fixture
def no_scontrol_in_steps(slurm, tmp_path):
    """PATH for the job whose `scontrol` fails inside an srun step, as in a container (and logs the
    call), and is the real one in the batch script. (ddpkit may ask it for the node list and reads
    the list itself when that fails; it must never need it to requeue.)"""
    bin_dir, log = tmp_path / "bin", tmp_path / "scontrol-in-steps.log"
    bin_dir.mkdir()
    real = next(p for p in ("/usr/bin/scontrol", "/usr/local/bin/scontrol") if os.path.exists(p))
    shim = bin_dir / "scontrol"
    shim.write_text(
        "#!/bin/sh\n"
        f'if [ -n "$SLURM_STEP_ID" ]; then echo "$SLURM_STEP_ID $*" >> {log}; '
        'echo "scontrol: not in this container" >&2; exit 127; fi\n'
        f'exec {real} "$@"\n'
    )
    shim.chmod(0o755)
    env = {**slurm.env, "PYTHONPATH": str(REPO / "src"), "PATH": f"{bin_dir}:{slurm.env['PATH']}"}
    yield env
    calls = log.read_text().splitlines() if log.exists() else []
    assert not [c for c in calls if "requeue" in c], calls


def _submit(env, tmp_path, run_dir, *slurm_args, task_args=()):
    proc = run_ddpkit(
        "slurm", "--nodes", "2", "--shared-run-dir", "--submit", *slurm_args,
        "--", TASK, *task_args, *TRAIN, "--run-dir", str(run_dir),
        cwd=tmp_path, env=env, timeout=60,
    )  # fmt: skip
    return int(proc.stdout.split("submitted job ")[1].split(";")[0])


def _wait_for(path, slurm, job, timeout=120):
    """Until `path` exists and, for metrics.jsonl, holds a line."""
    deadline = time.monotonic() + timeout
    while not (path.exists() and (path.suffix != ".jsonl" or path.read_text().strip())):
        assert time.monotonic() < deadline, f"no {path}\n{slurm.diagnostics(job)}"
        time.sleep(0.1)


def _check_resumed(run_dir, log, reference):
    assert "ddpkit: resuming from" in log, log
    assert_state_equal(load_model(run_dir), load_model(reference))
    epochs = [json.loads(x)["epoch"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert epochs == list(range(1, 41)), epochs  # no epoch lost or logged twice
    assert not (run_dir / "requeue-request").exists()


def test_a_second_signal_during_the_save_changes_nothing_and_the_job_is_requeued_once(
    slurm, tmp_path, reference, no_scontrol_in_steps
):
    run_dir = tmp_path / "job"
    held = ["--task-arg", "slow=0.02", "--task-arg", "hold_save=1"]
    job = _submit(no_scontrol_in_steps, tmp_path, run_dir, task_args=held)
    _wait_for(run_dir / "metrics.jsonl", slurm, job)  # training is under way
    slurm.signal(job, "USR2", scope="steps")  # what --signal=USR2@90 sends before the time limit
    _wait_for(run_dir / "saving-0", slurm, job)  # the checkpoint is being written, and waits ...
    slurm.signal(job, "USR2", scope="steps")  # ... for this second signal
    result = slurm.wait(job, timeout=150)
    log = next(run_dir.glob("slurm-*.out")).read_text()
    assert result.state == "COMPLETED" and result.restarts == 1, (result, log)
    for rank in (0, 1):  # each rank received the second signal inside the save, and carried on
        assert json.loads((run_dir / f"held-{rank}.json").read_text()) == {"first": "SIGUSR2", "repeats": 1}
    assert log.count(REQUEUED) == 1 and log.count("ddpkit: resuming from") == 1, log
    assert "the batch script requeues SLURM job" in log, log
    saved = [p.name for p in (run_dir / "checkpoints").iterdir()]
    assert len(saved) == 1, saved  # the stop's checkpoint, whole: the resume above loaded it
    _check_resumed(run_dir, log, reference)


def test_scontrol_requeue_from_outside_saves_at_the_next_step_and_is_requeued_once(
    slurm, tmp_path, reference, no_scontrol_in_steps
):
    # Preemption and an admin's requeue look the same to the job: SIGTERM to every task, SIGKILL
    # KillWait later (5 s here). The workers save at the next step; SLURM itself requeues the job
    run_dir = tmp_path / "job"
    job = _submit(no_scontrol_in_steps, tmp_path, run_dir, task_args=["--task-arg", "slow=0.02"])
    _wait_for(run_dir / "metrics.jsonl", slurm, job)
    slurm.requeue(job)
    result = slurm.wait(job, timeout=150)
    log = next(run_dir.glob("slurm-*.out")).read_text()
    assert result.state == "COMPLETED" and result.restarts == 1, (result, log)
    assert "stopped by SIGTERM: SLURM ends or requeues the job" in log and REQUEUED not in log, log
    saved = [p.name for p in (run_dir / "checkpoints").iterdir()]
    assert len(saved) == 1, saved  # --save-every 0: the checkpoint of the SIGTERM ...
    assert f"ddpkit: resuming from {run_dir / 'checkpoints' / saved[0]}" in log, log  # ... is where it went on
    _check_resumed(run_dir, log, reference)


def test_each_element_of_an_array_is_warned_before_its_time_limit_requeued_and_resumed_on_its_own(
    slurm, tmp_path, reference, no_scontrol_in_steps
):
    # --time 2 with the warning 60 s before: SLURM checks warnings every 30 s and sends one that
    # would be due before the next check, so it arrives 30-60 s into a run (one that comes while the
    # workers start is kept: a stop after their first step). The first run trains slowly (0.35 s a
    # forward pass: 70 s), a resumed one at full speed. Both elements run at once, on both nodes.
    run_dir = tmp_path / "array"
    slow = ["--task-arg", "slow=0.35"]
    job = _submit(no_scontrol_in_steps, tmp_path, run_dir, "--array", "0-1", "--time", "2", "--signal", "USR2@60",
                  task_args=slow)  # fmt: skip
    for index in (0, 1):
        result = slurm.wait(f"{job}_{index}", timeout=240)
        log = (run_dir / f"slurm-{job}_{index}.out").read_text()
        assert result.state == "COMPLETED" and result.restarts >= 1, (result, log)
        assert log.count(REQUEUED) == result.restarts, log  # one requeue per warning
        assert f"ddpkit: resuming from {run_dir / str(index) / 'checkpoints'}" in log, log
        _check_resumed(run_dir / str(index), log, reference)
