"""Rank 0's requeue request after a stop by signal (registry.request_requeue asks Slurm.requeue), in this process."""

import os
import signal

from ddpkit.environments.registry import request_requeue
from ddpkit.training.signals import StopRequest


def _stopped_by(sig):
    stop = StopRequest(["USR2", "TERM"])
    os.kill(os.getpid(), sig)
    stop.restore()
    return stop


def test_under_the_generated_script_rank_0_writes_the_request_and_runs_no_scontrol(tmp_path, monkeypatch, capsys):
    request = tmp_path / "requeue-request"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("DDPKIT_REQUEUE_FILE", str(request))
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol anywhere: it is not needed
    request_requeue(_stopped_by(signal.SIGUSR2))
    assert request.read_text() == "4242\n" and [p.name for p in tmp_path.iterdir()] == ["requeue-request"]
    assert "the batch script requeues SLURM job 4242" in capsys.readouterr().out


def test_a_sigterm_stop_requests_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("DDPKIT_REQUEUE_FILE", str(tmp_path / "requeue-request"))
    request_requeue(_stopped_by(signal.SIGTERM))
    assert not (tmp_path / "requeue-request").exists()
    assert "stopped by SIGTERM: SLURM ends or requeues the job" in capsys.readouterr().out


def test_without_the_script_and_without_scontrol_the_user_is_told_what_to_do(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("DDPKIT_REQUEUE_FILE", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # a container without SLURM's tools
    request_requeue(_stopped_by(signal.SIGUSR2))
    err = capsys.readouterr().err
    assert "scontrol is not available here" in err and "was not requeued" in err and "ddpkit slurm" in err


def test_outside_a_slurm_job_nothing_is_requeued_and_the_user_is_told(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("DDPKIT_REQUEUE_FILE", str(tmp_path / "requeue-request"))
    request_requeue(_stopped_by(signal.SIGUSR2))
    assert not (tmp_path / "requeue-request").exists()
    assert (
        capsys.readouterr().out == "ddpkit: --requeue: not inside a SLURM job; stopping after the checkpoint instead\n"
    )
