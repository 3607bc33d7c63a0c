import dataclasses
import re

import pytest

from ddpkit import DdpkitError, RunConfig, config


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(nproc=0), "--nproc must be a positive integer"),
        (dict(nproc=-3), "--nproc must be a positive integer"),
        (dict(epochs=0), "--epochs must be a positive integer"),
        (dict(batch_size=0), "--batch-size"),
        (dict(lr=-1.0), "--lr must be positive"),
        (dict(seed=-1), "--seed must be an integer from 0 to 2147483647, got -1"),
        (dict(seed=2**32), "--seed must be an integer from 0 to 2147483647"),
        (dict(backend="mpi"), "--backend must be one of"),
        (dict(device="tpu"), "--device must be one of"),
        (dict(backend="nccl", device="cpu"), "--backend nccl needs --device cuda"),
        (dict(resume=True), "--resume needs --run-dir"),
        (dict(timeout=0), "--timeout"),
        (dict(save_every=-1), "--save-every"),
    ],
)
def test_bad_config_is_refused_with_the_flag_named(kwargs, fragment):
    with pytest.raises(DdpkitError, match=fragment.replace("-", r"\-")):
        RunConfig(**kwargs)


def test_config_round_trips_through_a_dict():
    cfg = RunConfig(task="x.py:f", nproc=3, lr=0.5, extra={"k": 1})
    assert RunConfig.from_dict(cfg.as_dict()) == cfg


# one bad value per group, with the message that group's own check gives
GROUP_CASES = [
    (config.PROCESSES, {"threads": 0}, "--threads must be a positive integer, got 0"),
    (config.PROCESSES, {"tee": "5"}, "--tee must be 0-3"),
    (config.NODES, {"nnodes": "2"}, "--nnodes 2 needs --master-addr"),
    (config.NODES, {"rdzv_conf": "join_timeout"}, "--rdzv-conf must be KEY=VALUE"),
    (config.TRAINING, {"warmup_steps": -1}, "--warmup-steps must be 0 or a positive number"),
    (config.TRAINING, {"backend": "nccl", "device": "cpu"}, "--backend nccl needs --device cuda"),
    (config.FAULTS, {"best_metric": "eval loss"}, "--best-metric must be a metrics.jsonl name"),
    (config.FAULTS, {"resume": True}, "--resume needs --run-dir"),
    (config.OUTPUT, {"progress": "dots"}, "--progress must be one of auto, bar, lines, got 'dots'"),
    (config.PERFORMANCE, {"grad_sync": "shm", "grad_compression": "bf16"}, "--grad-sync shm sums float32 gradients"),
    (config.STRATEGY, {"strategy": "fsdp", "nproc": 1}, "--strategy fsdp shards the model across processes"),
    (config.STRATEGY, {"strategy": "fsdp", "nproc": 2, "static_graph": True}, "--static-graph: DDP options"),
]


@pytest.mark.parametrize("group, changes, message", GROUP_CASES)
def test_each_rule_belongs_to_one_group_and_the_config_refuses_it(group, changes, message):
    with pytest.raises(DdpkitError, match=re.escape(message)):
        RunConfig(**changes)
    cfg = RunConfig()
    for name, value in changes.items():  # the bad values on a built config, to ask each group alone
        object.__setattr__(cfg, name, value)
    for name, check in config.VALIDATIONS.items():
        if name == group:
            with pytest.raises(DdpkitError, match=re.escape(message)):
                check(cfg)
        else:
            check(cfg)  # no other group judges these settings


def test_every_group_of_flags_has_its_check():
    groups = {f.metadata["group"] for f in dataclasses.fields(RunConfig) if f.metadata.get("cli", True)}
    assert groups == set(config.VALIDATIONS)
