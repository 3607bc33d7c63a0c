"""A run folder in a bucket on two nodes (two agents on this host, one c10d endpoint, each node
staging the run in a temporary folder of its own, as two pods would), against a real
S3-compatible server on loopback (moto's). Every rank uploads its shards from its own node, rank
0 commits; a worker's crash restarts both nodes, which resume from the bucket (the node without
rank 0 holds no checkpoint of its own: it fetches the committed one); a second job resumes from
the bucket; the model equals a one-node run's."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, max_abs_diff

TASK = str(REPO / "tests" / "cluster" / "scripts" / "wine_float64_sgd.py") + ":build"
# test_sharded_snapshots' reference (one node, 2 processes): 9 steps an epoch, shared
REFERENCE = (TASK, "--epochs", "8", "--batch-size", "8", "--seed", "5", "--threads", "1", "--nproc", "2")
REFERENCE += ("--save-every", "0", "--eval-every", "1000", "--quiet")
NODE = (TASK, "--batch-size", "8", "--seed", "5", "--threads", "1", "--nproc", "1", "--nnodes", "2")
NODE += ("--save-every", "0", "--eval-every", "1000", "--strategy", "fsdp", "--save-every-steps", "9")
MANIFEST = ".manifest.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(args: tuple[str, ...], env: dict[str, str], home: Path, job: str) -> list[str]:
    """Both nodes of one job, each with a TMPDIR (its staging folder's parent) of its own; their outputs."""
    port, procs = _free_port(), []
    rdzv = ("--rdzv-id", job, "--rdzv-endpoint", f"127.0.0.1:{port}", "--timeout", "60")
    for node in (0, 1):
        tmp = home / f"node{node}"
        tmp.mkdir(exist_ok=True)
        full = {**os.environ, "PYTHONPATH": str(REPO / "src"), **env, "TMPDIR": str(tmp)}
        cmd = [sys.executable, "-m", "ddpkit", "train", *NODE, *rdzv, *args]
        procs.append(subprocess.Popen(cmd, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n=====\n".join(outputs)
    return outputs


@pytest.mark.slow
def test_a_two_node_fsdp_run_in_a_bucket_restarts_and_resumes_from_it_and_equals_a_one_node_run(
    s3_server, reference_run, tmp_path
):
    s3, bucket = s3_server, s3_server.bucket("nodes")
    url = f"s3://{bucket}/wine"
    # rank 1 dies in step 23 of its first attempt: the newest commit is step 18's; both nodes restart
    crash = {**s3.env, "WINE_EXIT_STEP": "23", "WINE_EXIT_RANK": "1"}
    first = _two_nodes(
        ("--epochs", "4", "--max-restarts", "1", "--snapshot-every-steps", "0", "--run-dir", url), crash, tmp_path, "a"
    )
    said = "\n".join(first)
    assert f"resuming from {url}/checkpoints/epoch-000002" in said, said
    keys = s3.keys(bucket, "wine/")
    for name in ("epoch-000002", "epoch-000004"):
        assert f"wine/checkpoints/{name}{MANIFEST}" in keys, keys
        assert {f"wine/checkpoints/{name}/__{r}_0.distcp" for r in (0, 1)} <= set(keys), keys
    assert not [k for k in keys if ".reports/" in k or ".partial" in k], keys

    puts: list[str] = []
    s3.on_request = lambda method, path: method == "PUT" and puts.append(path) and False
    try:
        second = _two_nodes(("--epochs", "8", "--resume", "--run-dir", url), s3.env, tmp_path, "b")
    finally:
        s3.on_request = None
    # the run's other files come from rank 0's node alone: the other node's copies (fetched at the start) stay there
    assert sum(p.endswith("/wine/summary.json") for p in puts) == 1, puts
    assert f"resuming from {url}/checkpoints/epoch-000004 (epoch 4 done)" in "\n".join(second), second
    summary = json.loads(s3.get(bucket, "wine/summary.json"))  # rank 0's node's, not the other's stale copy
    assert summary["run_dir"] == url and summary["steps_done"] == 72 and summary["world_size"] == 2, summary
    epochs = [json.loads(line).get("epoch") for line in s3.get(bucket, "wine/metrics.jsonl").splitlines()]
    assert max(e for e in epochs if e is not None) == 8, epochs
    model = torch.load(io.BytesIO(s3.get(bucket, "wine/model.pt")), weights_only=True)
    reference = torch.load(reference_run(*REFERENCE) / "model.pt", weights_only=True)
    assert max_abs_diff(model, reference) <= 1e-6
    assert not list(tmp_path.glob("node*/ddpkit-*")), "a node's staging folder outlived the job"
    secret = s3.env["AWS_SECRET_ACCESS_KEY"].encode()
    assert all(secret not in s3.get(bucket, key) for key in s3.keys(bucket))
