"""The store's failures against a real S3-compatible server (moto's, on loopback) that answers
as a store that refuses does (its HTTP error, its S3 error code): one line each, naming the
URL and what to check; throttling retried with backoff, a bounded number of times."""

from __future__ import annotations

import time

import pytest

from conftest import run_ddpkit
from ddpkit.storage.errors import StoreError
from ddpkit.storage.location import Remote
from ddpkit.storage.remote import RemoteRun


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    yield s3_server
    s3_server.on_request = None


def test_access_denied_is_one_line_before_any_worker_starts(s3_env, tmp_path):
    s3_env.bucket("denied")
    s3_env.on_request = lambda method, path: ("403 Forbidden", "AccessDenied")
    proc = run_ddpkit(
        "train",
        "--nproc",
        "2",
        "--epochs",
        "1",
        "--run-dir",
        "s3://denied/x",
        env=s3_env.env,
        cwd=tmp_path,
        check=False,
    )
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 2 and "Traceback" not in out and len(out.splitlines()) == 1, out
    assert "s3://denied/x: access denied while checking the bucket" in out and "AWS_ACCESS_KEY_ID" in out, out
    assert s3_env.env["AWS_SECRET_ACCESS_KEY"] not in out and list(tmp_path.iterdir()) == []


def test_throttling_is_retried_with_backoff_then_one_line(s3_env, monkeypatch):
    s3_env.bucket("slow")
    seen = []

    def slow_down(times: int):
        def answer(method: str, path: str):
            if method == "PUT":
                seen.append(time.monotonic())
                return ("503 Slow Down", "SlowDown") if len(seen) <= times else None
            return None

        return answer

    run = RemoteRun(Remote("s3", "slow/run"))
    s3_env.on_request = slow_down(2)  # two refusals, then served: the write goes through
    run.preflight()
    assert len(seen) == 3 and seen[-1] - seen[0] > 0.05, seen

    seen.clear()
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # botocore's variable: a shorter test, the same bound
    s3_env.on_request = slow_down(10**6)  # never served: a bounded number of tries, then one line
    start = time.monotonic()
    with pytest.raises(StoreError) as e:
        RemoteRun(Remote("s3", "slow/run")).preflight()
    assert time.monotonic() - start < 30 and 2 <= len(seen) <= 6, seen
    line = str(e.value)
    assert "s3://slow/run" in line and "throttling" in line and "\n" not in line, line


def test_a_runs_files_go_up_and_come_back_with_the_scores_keep_best_needs(s3_env, tmp_path):
    s3_env.bucket("files")
    local = tmp_path / "run"
    (local / "checkpoints" / "epoch-000001").mkdir(parents=True)
    (local / "config.json").write_text("{}")
    (local / "checkpoints" / "metrics.json").write_text('{"epoch-000001": 0.5}')
    (local / "checkpoints" / "epoch-000001" / "__0_0.distcp").write_bytes(b"shard")
    run = RemoteRun(Remote("s3", "files/run"))
    assert run.put_run_files(local) == ["checkpoints/metrics.json", "config.json"]
    back = tmp_path / "back"
    assert sorted(run.get_run_files(back)) == ["checkpoints/metrics.json", "config.json"]
    assert (back / "checkpoints" / "metrics.json").read_text() == '{"epoch-000001": 0.5}'


@pytest.mark.parametrize(
    "answer",
    [("507 Insufficient Storage", "XMinioStorageFull"), ("403 Forbidden", "QuotaExceeded")],
    ids=["minio", "ceph"],
)
def test_a_full_store_is_named_full_not_denied(s3_env, answer):
    """MinIO says 507 XMinioStorageFull, Ceph's gateway 403 QuotaExceeded: both are a full
    bucket (free space or raise the quota), not credentials to check."""
    s3_env.bucket("quota")
    s3_env.on_request = lambda method, path: answer if method == "PUT" else None
    with pytest.raises(StoreError) as e:
        RemoteRun(Remote("s3", "quota/run")).preflight()
    line = str(e.value)
    assert "s3://quota/run: the bucket is full (its quota)" in line and "access denied" not in line, line
