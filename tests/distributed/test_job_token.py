"""A two-node c10d job (two agents on this host, one rendezvous endpoint) started with a job
token, and what reaches its rendezvous port without the token: a ddpkit node with none, one with
another token, and a raw TCPStore client that lists the keys, reads them and plants a crafted
rendezvous state under the name torch would use. The nodes without the token are refused in one
line, the client learns nothing and its pickle never runs, the job trains the model of a one-node
run, and the token is in no output and no file of the run but the token file."""

import base64
import os
import pickle
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import OWN_LOOP, OWN_LOOP_EPOCHS, REPO, assert_state_close, load_model

WINE = ("--seed", "5", "--save-every", "2", "--epochs", "6", "--quiet")  # as test_local_attacks' reference
RDZV_ID = "token-test"


class RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(port: int, run_dir: Path, *extra: str, **env: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ddpkit", "train", "--nproc", "1", "--nnodes", "2", "--rdzv-id", RDZV_ID]
    cmd += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--timeout", "60", "--run-dir", str(run_dir), *WINE, *extra]
    full = {k: v for k, v in os.environ.items() if not k.startswith("DDPKIT_JOB_TOKEN")}
    full.update(PYTHONPATH=str(REPO / "src"), **env)
    return subprocess.Popen(cmd, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _outsider(port: int, marker: Path) -> tuple[list[str], list[bytes]]:
    """Connect as anyone may, wait for the job's keys, read them all, plant a crafted state."""
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))
    deadline = time.monotonic() + 30
    while not any(n.startswith("ddpkit-") or n.startswith("torch.") for n in store.list_keys()):
        assert time.monotonic() < deadline, "the host node wrote no rendezvous state within 30 s"
        time.sleep(0.2)  # the host has written its state: one node of two, waiting
    names = store.list_keys()
    values = [store.get(n) for n in names]
    crafted = base64.b64encode(pickle.dumps(RunsCode(marker))).decode()
    store.set(f"torch.rendezvous.{RDZV_ID}", crafted)  # torch's own name for the rendezvous state
    return names, values


def test_a_job_token_keeps_out_every_node_and_client_without_it(tmp_path, reference_run):
    token_file = tmp_path / "token"
    token = "t0k3n-" + os.urandom(16).hex()
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    port, run_dir, marker = _free_port(), tmp_path / "run", tmp_path / "ran"
    host = _node(port, run_dir, DDPKIT_JOB_TOKEN_FILE=str(token_file))
    try:
        names, values = _outsider(port, marker)
        no_token = _node(port, run_dir)
        other_token = _node(port, run_dir, DDPKIT_JOB_TOKEN="another-" + "x" * 20)
        refused = [p.communicate(timeout=60)[0] for p in (no_token, other_token)]
        second = _node(port, run_dir, DDPKIT_JOB_TOKEN=token)
        outputs = [p.communicate(timeout=120)[0] for p in (host, second)]
    finally:
        for p in (host,):
            p.kill()
    assert (no_token.returncode, other_token.returncode) == (2, 2), refused
    assert "was started with a job token and this node has none: set DDPKIT_JOB_TOKEN_FILE" in refused[0], refused
    assert "this node's job token is not the one of the job at 127.0.0.1:" in refused[1], refused
    assert (host.returncode, second.returncode) == (0, 0), outputs

    # what the outsider saw: names and values that carry neither the job's id nor its addresses
    assert sorted(n for n in names if not n.startswith("ddpkit-sealed/")) == ["ddpkit/job-token-check"], names
    assert not any(b"127.0.0.1" in v or RDZV_ID.encode() in v for v in values)
    assert not marker.exists()  # the planted pickle was never read
    reference = load_model(reference_run("--nproc", "2", *WINE))
    assert_state_close(load_model(run_dir), reference, rtol=1e-6, atol=1e-7)
    # the token: in no output, and in no file of the run
    assert not any(token in text for text in [*outputs, *refused])
    leaked = [p for p in run_dir.rglob("*") if p.is_file() and token.encode() in p.read_bytes()]
    assert leaked == []


def _pod(rank: int, port: int, out: Path, *cmd: str, **env: str) -> subprocess.Popen:
    """One pod of a PyTorchJob (or one srun task): a worker that reads its rank from the environment
    and whose rank 0 serves the workers' TCPStore on MASTER_ADDR:MASTER_PORT; the own loop's
    example unless `cmd` names another program."""
    full = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    full = {k: v for k, v in full.items() if not k.startswith("DDPKIT_JOB_TOKEN")}
    full.update(PYTHONPATH=str(REPO / "src"), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    full.update(RANK=str(rank), **env)
    cmd = cmd or (sys.executable, OWN_LOOP, "--epochs", OWN_LOOP_EPOCHS, "--out", str(out))
    return subprocess.Popen(cmd, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finished(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Every process's output once it ended (any still running after `timeout` is killed)."""
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def test_the_workers_store_of_rank_0_serves_only_workers_with_the_token(tmp_path, own_loop_launched):
    """No agent, no rendezvous: the workers' store alone (SLURM's tasks, a PyTorchJob's pods). A raw
    client reads only sealed names and values; a worker without the token that claims rank 1
    before the real one is never part of the job; the job ends at `ddpkit launch`'s model."""
    token, port = "pod-" + os.urandom(16).hex(), _free_port()
    rank0 = _pod(0, port, tmp_path / "pod0", DDPKIT_JOB_TOKEN=token)
    impostor = rank1 = None
    try:
        # counted as one of the 2 workers rank 0's store waits for: then rank 0 forms its process group
        store = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=60))
        deadline = time.monotonic() + 60
        while not store.list_keys():  # until rank 0 has published its gloo address
            assert time.monotonic() < deadline and rank0.poll() is None, "rank 0 published nothing"
            time.sleep(0.2)
        names = store.list_keys()
        values = [store.get(n) for n in names]
        impostor = _pod(1, port, tmp_path / "impostor")
        time.sleep(3)  # it connects, writes its own address and waits
        rank1 = _pod(1, port, tmp_path / "pod1", DDPKIT_JOB_TOKEN=token)
        outputs = [p.communicate(timeout=120)[0] for p in (rank0, rank1)]
        impostor_output = impostor.communicate(timeout=60)[0]  # it fails once the job's store is gone
    finally:
        for p in (rank0, rank1, impostor):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate()
    assert (rank0.returncode, rank1.returncode) == (0, 0), "\n---\n".join([*outputs, impostor_output])
    assert impostor.returncode != 0 and "Connection was likely closed" in impostor_output, impostor_output
    assert names and all(n.startswith("ddpkit-sealed/") for n in names), names
    assert not any(b"127.0.0.1" in v for v in values)
    final = torch.load(tmp_path / "pod0" / "final.pt", weights_only=True)["model"]
    assert_state_close(final, own_loop_launched[1]["model"], rtol=1e-6, atol=1e-7)
    assert not any(token in text for text in outputs)


SUBGROUP_AFTER_INIT = """
import gc, sys
import torch, torch.distributed as dist
import ddpkit
with ddpkit.init(timeout=30) as rt:
    gc.collect()  # what the interpreter may do at any moment after init: rank 0's store must survive it
    if rt.rank == 1:
        import time; time.sleep(1)  # rank 0 is done with the store before rank 1 uses it again
    group = dist.new_group([0, 1])  # a subgroup (a device mesh's dims) meets through the workers' store
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    rt.print(f"sum {t.item():.0f}")
"""


def test_rank_0s_sealed_store_serves_the_job_for_as_long_as_the_group_lives(tmp_path):
    """With a token, rank 0's TCPStore is held by the sealing wrapper (a Python object): torch's
    process group keeps only its C++ part, so the store, and with it the job's meeting point, must
    not go when the wrapper is collected after init. A subgroup formed later (every device mesh
    does) meets through that store."""
    token, port = "pod-" + os.urandom(16).hex(), _free_port()
    program = (sys.executable, "-c", SUBGROUP_AFTER_INIT)
    procs = [_pod(r, port, tmp_path, *program, DDPKIT_JOB_TOKEN=token) for r in (0, 1)]
    outputs = _finished(procs, timeout=90)
    assert [p.returncode for p in procs] == [0, 0], "\n---\n".join(outputs)
    assert "sum 2" in outputs[0], outputs[0]


@pytest.mark.slow
def test_hsdp_across_two_nodes_with_a_token_forms_its_mesh_and_trains(tmp_path, reference_run):
    """The agents' store path (every SLURM job of ddpkit has a token): HSDP's device mesh forms its
    replicate and shard groups after init, through the sealed store. It crashed with torch's 'Not
    implemented' once the sealing wrapper was collected."""
    port, run_dir = _free_port(), tmp_path / "run"
    flags = ("--strategy", "hsdp", "--save-every", "0")
    nodes = [_node(port, run_dir, *flags, DDPKIT_JOB_TOKEN="hsdp-" + "y" * 20) for _ in range(2)]
    outputs = _finished(nodes, timeout=150)
    assert [p.returncode for p in nodes] == [0, 0], "\n---\n".join(outputs)
    reference = load_model(reference_run("--nproc", "2", *WINE))
    model = load_model(run_dir)  # the whole model, written once the mesh trained
    assert {k: v.shape for k, v in model.items()} == {k: v.shape for k, v in reference.items()}
