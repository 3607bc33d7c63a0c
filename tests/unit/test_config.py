import pytest

from ddpkit import DdpkitError, RunConfig


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(nproc=0), "--nproc must be a positive integer"),
    (dict(nproc=-3), "--nproc must be a positive integer"),
    (dict(epochs=0), "--epochs must be a positive integer"),
    (dict(batch_size=0), "--batch-size"),
    (dict(lr=-1.0), "--lr must be positive"),
    (dict(backend="mpi"), "--backend must be one of"),
    (dict(device="tpu"), "--device must be one of"),
    (dict(backend="nccl", device="cpu"), "--backend nccl needs --device cuda"),
    (dict(resume=True), "--resume needs --run-dir"),
    (dict(timeout=0), "--timeout"),
    (dict(save_every=-1), "--save-every"),
])
def test_bad_config_is_refused_with_the_flag_named(kwargs, fragment):
    with pytest.raises(DdpkitError, match=fragment.replace("-", r"\-")):
        RunConfig(**kwargs)


def test_config_round_trips_through_a_dict():
    cfg = RunConfig(task="x.py:f", nproc=3, lr=0.5, extra={"k": 1})
    assert RunConfig.from_dict(cfg.as_dict()) == cfg
