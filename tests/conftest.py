"""Shared helpers: run the real CLI in a subprocess, with a timeout, and read its run dir."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # this checkout's ddpkit, whatever is installed


def run_ddpkit(
    *args: str, cwd: Path | str | None = None, timeout: float = 240, env: dict | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """`python -m ddpkit ARGS`; fails the test with the output if it exits non-zero (when check)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO / "src"), **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "ddpkit", *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        pytest.fail(f"ddpkit {' '.join(args)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def load_model(run_dir: Path | str) -> dict[str, torch.Tensor]:
    return torch.load(Path(run_dir) / "model.pt", weights_only=True)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def assert_state_close(a, b, rtol=1e-5, atol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def assert_state_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs (max abs diff {(a[k] - b[k]).abs().max().item():.3g})"


def _shared_dir(tmp_path_factory) -> Path:
    """Where a reference run lives so that every pytest process of one test run finds it: the
    folder `make test` gives all its phases (DDPKIT_TEST_SHARED), else the one pytest-xdist's
    workers share (their base temp's parent), else this session's own base temp."""
    given = os.environ.get("DDPKIT_TEST_SHARED")
    if given:
        return Path(given)
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def _locked(path: Path):
    """One process at a time (the others wait): a reference run is trained once for all of them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _once(tmp_path_factory, kind: str, key: tuple[str, ...], make) -> Path:
    """The folder `make(folder)` fills, made once per test run for every process asking for
    (kind, key); a folder left half-made by a failed attempt is made again."""
    digest = hashlib.sha256("\0".join((kind, *key)).encode()).hexdigest()[:16]
    home = _shared_dir(tmp_path_factory) / "ddpkit-references" / f"{kind}-{digest}"
    with _locked(home.with_suffix(".lock")):
        if not (home / "done").exists():
            shutil.rmtree(home, ignore_errors=True)
            home.mkdir(parents=True)
            make(home)
            (home / "done").touch()
    return home


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """`reference_run(*ARGS)`: the run directory of `ddpkit train ARGS`, trained once per test
    run (shared by pytest-xdist's workers and make test's phases) for every test that asks for
    exactly these ARGS. A reference to compare with: read it, never resume or train into it
    (copy what a test changes)."""

    def run(*args: str) -> Path:
        home = _once(tmp_path_factory, "train", args, lambda d: run_ddpkit("train", *args, "--run-dir", str(d / "run")))
        return home / "run"

    return run


OWN_LOOP = str(REPO / "examples" / "own_loop.py")
OWN_LOOP_EPOCHS = "3"


@pytest.fixture(scope="session")
def own_loop_launched(tmp_path_factory):
    """`ddpkit launch --nproc 2 examples/own_loop.py --epochs 3`, run once per test run for every
    test that compares another launcher (torchrun, mpirun, Kubeflow's pods) with it: its
    stdout and its final.pt (loaded). Read them, never train into its folder."""

    def launch(home: Path) -> None:
        proc = run_ddpkit("launch", "--nproc", "2", OWN_LOOP, "--epochs", OWN_LOOP_EPOCHS, "--out", str(home / "out"))
        (home / "stdout.txt").write_text(proc.stdout)

    home = _once(tmp_path_factory, "own_loop", (OWN_LOOP_EPOCHS,), launch)
    return (home / "stdout.txt").read_text(), torch.load(home / "out" / "final.pt", weights_only=True)


class S3Server:
    """moto's S3 server on loopback, in this process; `on_request(method, path)`, when set, sees
    every request before the server serves it, and a true answer drops it unstored (a test kills
    a client in the middle of its upload: what it was sending never arrives whole), or answers it
    with an S3 error, ("403 Forbidden", "AccessDenied"), as a real store refuses."""

    def __init__(self) -> None:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # not a line per request in the test's output
        self.on_request = None
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        wsgi = self.server._server  # werkzeug's server: each request goes through its .app
        served = wsgi.app

        def hooked(environ, start_response):
            answer = self.on_request and self.on_request(environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""))
            if answer:  # dropped unstored: True as a bare 503, or (status, S3 error code) as the store says it
                status, code = answer if isinstance(answer, tuple) else ("503 Service Unavailable", "")
                body = f"<Error><Code>{code}</Code><Message>{code}</Message></Error>".encode() if code else b""
                start_response(status, [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
                return [body]
            return served(environ, start_response)

        wsgi.app = hooked
        host, port = self.server.get_host_and_port()
        self.env = {
            "AWS_ENDPOINT_URL": f"http://{host}:{port}",
            "AWS_ACCESS_KEY_ID": "test-key-id",
            "AWS_SECRET_ACCESS_KEY": "secret-that-must-never-be-stored",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        import boto3

        self.client = boto3.client(
            "s3",
            endpoint_url=self.env["AWS_ENDPOINT_URL"],
            aws_access_key_id="test-key-id",
            aws_secret_access_key="x",
            region_name="us-east-1",
        )

    def bucket(self, name: str) -> str:
        self.client.create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def get(self, bucket: str, key: str) -> bytes:
        return self.client.get_object(Bucket=bucket, Key=key)["Body"].read()

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=bucket, Key=key, Body=data)


@pytest.fixture(scope="module")
def s3_server():
    """A real S3-compatible server (moto's) on loopback for this module's tests: `.env` is what a
    run needs to find it by the backend's own conventions (AWS_ENDPOINT_URL, any key). In memory:
    every module starts with an empty server."""
    server = S3Server()
    try:
        yield server
    finally:
        server.server.stop()
