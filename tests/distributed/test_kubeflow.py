"""Kubeflow jobs played on one host with the exact variables Kubeflow sets in each pod (issue 15):
a PyTorchJob's pods (RANK/WORLD_SIZE/MASTER_*, no LOCAL_RANK) each run the script as one
worker; Kubeflow Trainer's torch runtime (PET_*) runs a launcher per pod: `ddpkit launch`
reads PET_* as torchrun does. Both end at the model `ddpkit launch --nproc 2` trains."""

import os
import socket
import subprocess
import sys

import pytest
import torch

from conftest import OWN_LOOP, OWN_LOOP_EPOCHS, REPO, assert_state_equal

SCRIPT = OWN_LOOP


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reference(own_loop_launched):
    return own_loop_launched[1]["model"]  # ddpkit launch --nproc 2 SCRIPT --epochs OWN_LOOP_EPOCHS


def _pods(argv_for, env_for, tmp_path):
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    procs = [
        subprocess.Popen(
            argv_for(i),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env={**base, "PYTHONPATH": str(REPO / "src"), **env_for(i)},
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=150) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    return outs


def test_pytorchjob_pods_are_one_job_not_two_single_runs(tmp_path, reference):
    port = _port()
    outs = _pods(
        lambda i: [sys.executable, SCRIPT, "--epochs", OWN_LOOP_EPOCHS, "--out", str(tmp_path / f"pod{i}")],
        lambda i: {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": "2",
            "RANK": str(i),
            "PYTHONUNBUFFERED": "0",
        },
        tmp_path,
    )
    assert "(world size 2)" in outs[0][0] and outs[1][0] == ""  # pod 0 is rank 0 and prints; pod 1 is silent
    assert_state_equal(torch.load(tmp_path / "pod0" / "final.pt", weights_only=True)["model"], reference)


def test_trainer_pet_variables_drive_ddpkit_launch_in_each_pod(tmp_path, reference):
    """With a job token (what `ddpkit k8s --job-token-secret` mounts from a Secret): the operator's
    master is met through c10d's sealed rendezvous, not the static one the token cannot seal."""
    port = _port()
    _pods(
        lambda i: [
            sys.executable,
            "-m",
            "ddpkit",
            "launch",
            SCRIPT,
            "--epochs",
            OWN_LOOP_EPOCHS,
            "--out",
            str(tmp_path / f"pod{i}"),
        ],
        lambda i: {
            "PET_NNODES": "2",
            "PET_NPROC_PER_NODE": "1",
            "PET_NODE_RANK": str(i),
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": str(port),
            "DDPKIT_JOB_TOKEN": "k8s-secret-token-0123456789",
        },
        tmp_path,
    )
    assert_state_equal(torch.load(tmp_path / "pod0" / "final.pt", weights_only=True)["model"], reference)
