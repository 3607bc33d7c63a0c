"""metrics.py: metrics.csv and TensorBoard follow metrics.jsonl, also across a resume."""

import pytest

from ddpkit.reporting.metrics import MetricsLog, read_metrics


def rec(epoch, loss):
    return {"epoch": epoch, "train_loss": loss, "lr": 0.1}


def test_on_resume_csv_and_tensorboard_drop_the_epochs_the_checkpoint_does_not_hold(tmp_path):
    tb = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    log = MetricsLog(tmp_path, enabled=True, csv=True, tensorboard=True)
    for e in (1, 2, 3):
        log.write(rec(e, 1.0 / e))
    log.close()
    # the run died after epoch 3; its newest checkpoint holds epoch 2; epoch 3 is redone
    log = MetricsLog(tmp_path, enabled=True, keep_until_epoch=2, csv=True, tensorboard=True)
    log.write(rec(3, 0.25))
    log.close()
    assert [r["train_loss"] for r in read_metrics(tmp_path)] == [1.0, 0.5, 0.25]
    assert (tmp_path / "metrics.csv").read_text().splitlines() == [
        "epoch,train_loss,lr",
        "1,1.0,0.1",
        "2,0.5,0.1",
        "3,0.25,0.1",
    ]
    acc = tb.EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss/train")] == [(1, 1.0), (2, 0.5), (3, 0.25)]


def test_other_ranks_write_nothing(tmp_path):
    log = MetricsLog(tmp_path, enabled=False, csv=True, tensorboard=True)
    log.write(rec(1, 1.0))
    log.close()
    assert list(tmp_path.iterdir()) == []


def test_tensorboard_without_the_package_is_refused_with_what_to_install(monkeypatch):
    import ddpkit.config as config

    monkeypatch.setattr(config.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(config.DdpkitError, match=r"pip install 'ddpkit\[tensorboard\]'"):
        config.RunConfig(tensorboard=True)


def test_a_metric_hook_that_is_not_a_function_is_refused():
    import torch

    from ddpkit import DdpkitError
    from ddpkit.task import as_task

    m = torch.nn.Linear(2, 2)
    ds = torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))
    with pytest.raises(DdpkitError, match="on_metrics must be a function"):
        as_task(
            {"model": m, "train_set": ds, "optimizer": torch.optim.SGD(m.parameters(), lr=0.1), "on_metrics": "wandb"}
        )
