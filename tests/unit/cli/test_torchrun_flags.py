"""`ddpkit launch` takes torchrun's flags, every spelling torchrun accepts, with torchrun's
meaning (issue 15). The same scripts run under both: tests/distributed/test_torchrun_compat.py."""

import pytest

from ddpkit import DdpkitError, RunConfig
from ddpkit.cli.commands import build_parser
from ddpkit.cli.flags import config_from
from ddpkit.launchers.plan import make_launch_plan


def _launch(*argv, env=None, monkeypatch=None):
    ns = build_parser().parse_args(["launch", *argv, "script.py", "--its-own", "flag"])
    assert ns.script == "script.py" and ns.args == ["--its-own", "flag"]
    return ns, config_from(ns)


def test_every_torchrun_flag_spelling_is_a_ddpkit_launch_flag():
    from torch.distributed.run import get_args_parser

    ours = {
        s for a in build_parser()._subparsers._group_actions[0].choices["launch"]._actions for s in a.option_strings
    }
    theirs = {s for a in get_args_parser()._actions for s in a.option_strings}
    assert theirs - ours == set()


def test_the_pytorch_examples_multinode_command_means_what_it_means_to_torchrun():
    # pytorch/examples distributed/ddp-tutorial-series: --node_rank beside a c10d endpoint is ignored by torchrun
    _, cfg = _launch(
        "--nproc_per_node=4",
        "--nnodes=2",
        "--node_rank=0",
        "--rdzv_id=456",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=127.0.0.1:29603",
    )
    assert (cfg.nproc, cfg.nnodes, cfg.node_rank, cfg.rdzv_id, cfg.rdzv_endpoint) == (
        4,
        "2",
        None,
        "456",
        "127.0.0.1:29603",
    )
    plan = make_launch_plan(cfg, 4, "cpu", False, 1)
    assert (plan.rdzv_backend, plan.rdzv_endpoint, plan.rdzv_id) == ("c10d", "127.0.0.1:29603", "456")


def test_static_spellings_and_c10d_at_the_master_address():
    _, cfg = _launch("--nnodes", "2", "--node_rank", "1", "--master_addr", "127.0.0.1", "--master_port", "29511")
    plan = make_launch_plan(cfg, 2, "cpu", False, 1)
    assert (plan.rdzv_backend, plan.rdzv_endpoint, plan.node_rank) == ("static", "127.0.0.1:29511", 1)
    _, cfg = _launch("--nnodes", "2", "--rdzv-backend", "c10d", "--master-addr", "127.0.0.1", "--master-port", "29512")
    assert (cfg.rdzv_endpoint, cfg.master_addr) == ("127.0.0.1:29512", None)
    _, cfg = _launch(
        "--nnodes", "2", "--node-rank", "0", "--rdzv_backend", "static", "--rdzv_endpoint", "127.0.0.1:29513"
    )
    assert (cfg.master_addr, cfg.master_port, cfg.rdzv_endpoint) == ("127.0.0.1", 29513, None)


def test_standalone_output_and_agent_flags():
    ns, cfg = _launch(
        "--standalone",
        "--nproc-per-node",
        "3",
        "--max_restarts",
        "2",
        "--monitor_interval",
        "0.5",
        "--start_method",
        "forkserver",
        "-r",
        "1",
        "-t",
        "2",
        "--local_ranks_filter",
        "0,2",
        "--log_dir",
        "/tmp/x",
        "--rdzv_conf",
        "join_timeout=30,is_host=0",
        "--role",
        "trainer",
        "--virtual_local_rank",
        "--shutdown_timeout",
        "5",
        "--no_python",
        "--run_path",
        "--module",
    )
    assert (cfg.standalone, cfg.nnodes, cfg.nproc, cfg.max_restarts, cfg.monitor_interval, cfg.start_method) == (
        True,
        "1",
        3,
        2,
        0.5,
        "forkserver",
    )
    assert (cfg.redirects, cfg.tee, cfg.local_ranks_filter, cfg.log_dir) == ("1", "2", "0,2", "/tmp/x")
    assert (ns.role, ns.virtual_local_rank, ns.shutdown_timeout, ns.no_python, ns.module) == (
        "trainer",
        True,
        5,
        True,
        True,
    )
    plan = make_launch_plan(cfg, 3, "cpu", False, 1)
    assert plan.rdzv_configs["join_timeout"] == 30 and plan.rdzv_configs["is_host"] is False
    assert (plan.monitor_interval, plan.redirects, plan.tee, plan.local_ranks_filter) == (0.5, "1", "2", "0,2")


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"tee": "4"}, "--tee must be 0-3"),
        ({"redirects": "all"}, "--redirects must be 0-3"),
        ({"local_ranks_filter": "0;1"}, "--local-ranks-filter"),
        ({"rdzv_conf": "join_timeout"}, "--rdzv-conf must be KEY=VALUE"),
        ({"monitor_interval": 0.0}, "--monitor-interval"),
    ],
)
def test_malformed_torchrun_values_are_one_clear_error(changes, message):
    with pytest.raises(DdpkitError, match=message):
        RunConfig(**changes)


def test_kubeflow_pet_variables_are_the_flags_defaults_as_for_torchrun(monkeypatch):
    # what Kubeflow Trainer's torch runtime / a PyTorchJob with nprocPerNode sets in every pod
    for k, v in {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "2",
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": "29400",
    }.items():
        monkeypatch.setenv(k, v)
    _, cfg = _launch()
    assert (cfg.nnodes, cfg.nproc, cfg.node_rank, cfg.master_addr, cfg.master_port) == ("2", 2, 1, "127.0.0.1", 29400)
    _, cfg = _launch("--nproc_per_node", "1")  # a flag still wins over its variable
    assert cfg.nproc == 1


def test_nproc_per_node_cpu_is_one_process_per_core_as_for_torchrun():
    import os

    assert _launch("--nproc_per_node", "cpu")[1].nproc == os.cpu_count()
