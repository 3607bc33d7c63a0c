"""A node of a SkyPilot task: SkyPilot's variables are the node flags of `ddpkit train` /
`launch` (a flag given still wins), a lone script on a multi-node task is refused, the workers
ddpkit starts are placed by torch's agent, and `ddpkit env` names SkyPilot."""

import pytest

from ddpkit import DdpkitError, DistEnv
from ddpkit.cli.commands import build_parser
from ddpkit.cli.flags import config_from
from ddpkit.environments.registry import launcher_defaults
from ddpkit.environments.skypilot import SkyPilot, node_defaults
from ddpkit.tools.doctor import collect, format_report

# what SkyPilot sets in the `run` of node 1 of a 2-node task with 8 GPUs a node
NODE1 = {
    "SKYPILOT_NODE_RANK": "1",
    "SKYPILOT_NODE_IPS": "10.0.0.7\n10.0.0.9\n",
    "SKYPILOT_NUM_NODES": "2",
    "SKYPILOT_NUM_GPUS_PER_NODE": "8",
}
CPU_NODE = {"SKYPILOT_NODE_RANK": "0", "SKYPILOT_NODE_IPS": "10.0.0.7", "SKYPILOT_NUM_NODES": "1"}


def test_the_variables_are_the_node_flags_node_0_is_the_master():
    assert node_defaults(NODE1) == {"nnodes": "2", "node_rank": "1", "nproc": "8", "master_addr": "10.0.0.7"}
    # a CPU node runs one worker; one node needs no master address (ddpkit's local rendezvous)
    assert node_defaults(CPU_NODE) == {"nnodes": "1", "node_rank": "0", "nproc": "1"}
    assert node_defaults({**CPU_NODE, "SKYPILOT_NUM_GPUS_PER_NODE": "0.5"})["nproc"] == "1"  # a fraction of a GPU
    assert launcher_defaults(NODE1) == node_defaults(NODE1) and launcher_defaults({}) == {}


def test_kubeflow_s_variables_win_a_field_both_give():
    both = {**NODE1, "PET_NNODES": "3", "PET_MASTER_PORT": "29400"}
    assert launcher_defaults(both) == {**node_defaults(NODE1), "nnodes": "3", "master_port": "29400"}


def test_ddpkit_train_on_a_node_reads_them_and_a_flag_still_wins(monkeypatch):
    for k, v in NODE1.items():
        monkeypatch.setenv(k, v)
    cfg = config_from(build_parser().parse_args(["train", "wine"]))
    assert (cfg.nnodes, cfg.node_rank, cfg.nproc, cfg.master_addr, cfg.master_port) == ("2", 1, 8, "10.0.0.7", None)
    cfg = config_from(build_parser().parse_args(["launch", "--nproc", "2", "s.py"]))
    assert (cfg.nnodes, cfg.node_rank, cfg.nproc) == ("2", 1, 2)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"SKYPILOT_NODE_RANK": "2"}, "inconsistent SkyPilot environment: SKYPILOT_NODE_RANK=2 SKYPILOT_NUM_NODES=2"),
        ({"SKYPILOT_NODE_IPS": "10.0.0.7"}, "SKYPILOT_NUM_NODES=2 but SKYPILOT_NODE_IPS names 1 address"),
        ({"SKYPILOT_NUM_GPUS_PER_NODE": "many"}, "SKYPILOT_NUM_GPUS_PER_NODE='many' is not a number"),
    ],
)
def test_variables_that_do_not_add_up_are_named(changes, message):
    broken = {**NODE1, **changes}
    with pytest.raises(DdpkitError, match=message):
        node_defaults(broken)
    assert SkyPilot().launcher_defaults(broken) == {}  # no flag defaults from them; `ddpkit env` says why
    assert any(message in w for w in collect(broken)["warnings"])


def test_the_workers_are_placed_by_torch_s_agent_never_by_skypilot():
    assert DistEnv.detect(NODE1).launcher == "single"  # the node's command: ddpkit starts the workers
    worker = {
        **NODE1,
        "RANK": "9",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "16",
        "MASTER_ADDR": "10.0.0.7",
        "MASTER_PORT": "1",
    }
    assert DistEnv.detect(worker).launcher == "torchrun"


def test_a_lone_script_on_a_multi_node_or_multi_gpu_task_is_refused():
    with pytest.raises(DdpkitError, match=r"runs on 2 node\(s\) x 8 GPU\(s\).*ddpkit launch SCRIPT.py"):
        DistEnv.detect_worker(NODE1)
    with pytest.raises(DdpkitError, match=r"1 node\(s\) x 4 GPU\(s\)"):
        DistEnv.detect_worker({**CPU_NODE, "SKYPILOT_NUM_GPUS_PER_NODE": "4"})
    assert DistEnv.detect_worker(CPU_NODE) == DistEnv()  # one node, one process: a script alone is the job


def test_ddpkit_env_names_skypilot_its_variables_and_node_0_as_master():
    report = collect({**NODE1, "PATH": "/nonexistent"})
    text = format_report(report)
    assert report["launcher"]["name"] == "skypilot" and report["launcher"]["nnodes"] == 2
    assert "detected    SkyPilot node (ddpkit starts this node's workers" in text
    assert "SKYPILOT_NODE_IPS=10.0.0.7 10.0.0.9" in text
    assert report["network"]["master_addr"] == "10.0.0.7"
    assert report["network"]["master_source"] == "the first of SKYPILOT_NODE_IPS"


def test_with_a_job_token_the_nodes_meet_through_the_sealed_c10d_rendezvous_on_node_0():
    """The static rendezvous (--master-addr) cannot be sealed, and a token refuses it: with
    DDPKIT_JOB_TOKEN (SkyPilot passes `secrets` as environment variables) node 0's address is
    the c10d endpoint instead, and the rendezvous assigns the node ranks."""
    sealed = {**NODE1, "DDPKIT_JOB_TOKEN": "t" * 43}
    assert node_defaults(sealed) == {"nnodes": "2", "nproc": "8", "rdzv_endpoint": "10.0.0.7:29500"}
    assert node_defaults({**NODE1, "DDPKIT_JOB_TOKEN_FILE": "/run/token"})["rdzv_endpoint"] == "10.0.0.7:29500"
    assert "rdzv_endpoint" not in node_defaults({**NODE1, "DDPKIT_JOB_TOKEN": "  "})  # empty: no token
    assert node_defaults({**CPU_NODE, "DDPKIT_JOB_TOKEN": "t" * 43}) == node_defaults(CPU_NODE)  # one node: none
