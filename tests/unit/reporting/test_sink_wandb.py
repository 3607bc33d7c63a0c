"""W&B (--tracker wandb) in process: online without credentials it is refused at once, never
an interactive login prompt waiting in the background (the whole run goes through W&B offline
in tests/distributed/test_trackers.py)."""

import pytest

from ddpkit.reporting.sinks import ResumePoint, SinkSettings, WandbSink

pytest.importorskip("wandb", reason="needs the wandb extra (pip install 'ddpkit[wandb]')")


def test_online_without_credentials_is_one_warning_not_a_prompt(tmp_path, monkeypatch, capsys):
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    sink = WandbSink()
    sink.retry_wait_s = 0.0
    sink.open(tmp_path, SinkSettings(config={"task": "wine"}), ResumePoint())
    sink.write({"epoch": 1, "step": 3, "train_loss": 0.5}, 3)
    sink.close()
    assert not sink.thread.is_alive() and sink.given_up
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ddpkit:")]
    assert err == [
        "ddpkit: warning: --tracker wandb could not start its run after 3 tries (RuntimeError: no W&B credentials: "
        "`wandb login`, WANDB_API_KEY, or WANDB_MODE=offline); training goes on without it (metrics.jsonl has every "
        "record)"
    ]
    assert not (tmp_path / "tracker-wandb.json").exists()
