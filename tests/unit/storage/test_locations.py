"""A run folder's location: a URL is never silently a local path, and the store's failures
are one line naming the URL."""

import errno
from pathlib import Path

import pytest

from ddpkit.errors import DdpkitError
from ddpkit.storage.errors import why
from ddpkit.storage.location import Remote, is_url, parse
from ddpkit.storage.remote import _safe_relative, order


def test_urls_and_paths_are_told_apart():
    assert parse("s3://ckpt/x/") == Remote("s3", "ckpt/x")
    assert parse("gs://b") == Remote("gs", "b") and parse("az://c/p/q").bucket == "c"
    assert parse("runs/a") == Path("runs/a") and parse("file:///tmp/r") == Path("/tmp/r")
    assert is_url("s3://b/p") and not is_url("runs/s3:x")


@pytest.mark.parametrize(
    "text, says",
    [
        ("s3:/ckpt/x", "write s3://ckpt/x"),  # what Path("s3://ckpt/x") makes of the URL
        ("ftp://host/x", "cannot store a run at ftp://"),
        ("s3://", "no bucket in the URL"),
    ],
)
def test_what_is_not_a_usable_location_is_refused(text, says):
    with pytest.raises(DdpkitError, match=says):
        parse(text)


def test_a_manifest_names_nothing_outside_its_checkpoint():
    assert _safe_relative("__0_0.distcp") == "__0_0.distcp"
    for bad in ("../x", "/etc/passwd", "a/../../b", "", "a\\b"):
        with pytest.raises(ValueError):
            _safe_relative(bad)


def test_checkpoints_sort_by_their_progress():
    names = ["epoch-000002.pt", "epoch-000002-step-000003.pt", "epoch-000010", "epoch-000003"]
    assert sorted(names, key=order) == [
        "epoch-000002.pt",
        "epoch-000002-step-000003.pt",
        "epoch-000003",
        "epoch-000010",
    ]


def test_failures_are_one_line_naming_the_url_and_what_to_check():
    remote = Remote("s3", "ckpt/run")
    denied = why(remote, PermissionError("Access Denied"), "uploading epoch-000002.pt")
    assert "s3://ckpt/run: access denied" in denied and "AWS_ACCESS_KEY_ID" in denied
    full = why(remote, OSError(errno.ENOSPC, "No space"), "uploading epoch-000002.pt")
    assert "the bucket is full" in full
    slow = why(remote, OSError("An error occurred (SlowDown) when calling PutObject"), "uploading x")
    assert "throttling" in slow and "attempts with backoff" in slow
    for line in (denied, full, slow):
        assert "\n" not in line


def test_a_trackers_params_name_the_bucket_not_the_staging_folder(monkeypatch):
    from ddpkit.config import RunConfig
    from ddpkit.reporting.sinks.base import SinkSettings
    from ddpkit.util.envvars import RUN_URL_VAR

    monkeypatch.setenv(RUN_URL_VAR, "s3://ckpt/run")
    params = SinkSettings.of(RunConfig(run_dir="/tmp/ddpkit-stage-x"), 2).params
    assert params["run_dir"] == "s3://ckpt/run" and params["world_size"] == 2
    assert not any("AWS" in str(k) or "secret" in str(v).lower() for k, v in params.items())
