"""The line a one-worker run stopped by Ctrl-C or a TERM ends with names a step only where the
stop's own checkpoint was written (the summary's checkpoint_step), never just the step it reached."""

import signal

import pytest

from ddpkit.config import RunConfig
from ddpkit.errors import Interrupted
from ddpkit.run.train import _ended_by_signal


def _ended(tmp_path, **summary):
    cfg = RunConfig(run_dir=str(tmp_path), save_on_signal="USR1")
    with pytest.raises(Interrupted) as raised:
        _ended_by_signal(cfg, {"stopped_early": True, "stop_signal": "SIGTERM", "steps_done": 12, **summary}, 1)
    assert raised.value.exit_code == 128 + signal.SIGTERM
    return raised.value


def test_a_stop_whose_checkpoint_was_written_names_its_step(tmp_path):
    e = _ended(tmp_path, checkpoint_step=12)
    assert str(e) == (
        f"stopped by SIGTERM after saving a checkpoint at step 12: continue with --resume --run-dir {tmp_path}"
    )
    assert e.saved_step == 12


@pytest.mark.parametrize("written", [None, 9])
def test_a_stop_without_its_own_checkpoint_claims_none(tmp_path, written):
    (tmp_path / "checkpoints").mkdir()
    if written is not None:
        (tmp_path / "checkpoints" / "epoch-000003.pt").write_bytes(b"")
    e = _ended(tmp_path, checkpoint_step=written)
    assert "after saving" not in str(e) and e.saved_step is None, e
    if written is None:
        assert str(e) == "stopped by SIGTERM before a checkpoint was written (--save-on-signal TERM saves one first)"
    else:
        assert str(e) == (
            "stopped by SIGTERM; nothing newer was saved (--save-on-signal TERM saves one first): "
            f"--resume continues from the newest checkpoint in {tmp_path / 'checkpoints'}"
        )


def test_a_run_that_finished_or_asked_a_requeue_returns_its_summary(tmp_path):
    cfg = RunConfig(run_dir=str(tmp_path))
    for summary in ({"stopped_early": False}, {"stopped_early": True, "stop_signal": "SIGUSR1"}):
        assert _ended_by_signal(cfg, summary, 1) is summary
    several = {"stopped_early": True, "stop_signal": "SIGTERM", "steps_done": 3, "checkpoint_step": 3}
    assert _ended_by_signal(cfg, several, 2) is several  # their launcher decides the job's status
