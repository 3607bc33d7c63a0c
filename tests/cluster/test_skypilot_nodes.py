"""What `ddpkit sky` writes, run as SkyPilot runs it: the task's `run` line, unchanged, on two
real "nodes" (network namespaces, each its own address), each with the variables SkyPilot sets
on a node (SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS, SKYPILOT_NUM_NODES, SKYPILOT_NUM_GPUS_PER_NODE
on CPU nodes: one worker each). ddpkit reads them as its node flags: the two nodes must train
the model of a single-node run of the same world size (2: the sum of two gradients does not
depend on the order)."""

import json
import os
import sys

import pytest
import yaml

from conftest import REPO, assert_state_close, load_model, run_ddpkit

pytestmark = pytest.mark.cluster

TRAIN = ["wine", "--epochs", "3", "--batch-size", "8", "--seed", "5", "--timeout", "60", "--threads", "1"]


def test_the_run_line_on_two_skypilot_nodes_trains_the_single_node_model(two_nodes, tmp_path, reference_run):
    run_dir, task_file = tmp_path / "run", tmp_path / "task.yaml"
    # --shared-run-dir: the two namespaces see this machine's disk, as a bucket would be seen
    flags = ["--nodes", "2", "--shared-run-dir", "--run-dir", str(run_dir), "--yaml", str(task_file)]
    run_ddpkit("sky", *flags, "--", *TRAIN)
    task = yaml.safe_load(task_file.read_text())
    assert task["num_nodes"] == 2 and "--nproc" not in task["run"] and "--master-addr" not in task["run"]
    shim = tmp_path / "bin" / "ddpkit"  # the `ddpkit` of the run line: this checkout's
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m ddpkit "$@"\n')
    shim.chmod(0o755)
    ips = "\n".join(node.ip for node in two_nodes.nodes)
    variables = {"SKYPILOT_NODE_IPS": ips, "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NUM_GPUS_PER_NODE": "0"}
    # the task's secret, as SkyPilot hands it to every node (the launch line made it)
    assert task["secrets"] == {"DDPKIT_JOB_TOKEN": None}, task
    variables["DDPKIT_JOB_TOKEN"] = "sky-" + os.urandom(16).hex()
    runs = two_nodes.run_all(
        [
            (
                node,
                [
                    "env",
                    f"SKYPILOT_NODE_RANK={rank}",
                    *(f"{k}={v}" for k, v in variables.items()),
                    "bash",
                    "-c",
                    task["run"],
                ],
            )
            for rank, node in enumerate(two_nodes.nodes)
        ],
        timeout=150,
        env={"PATH": f"{shim.parent}:{os.environ.get('PATH', '/usr/bin:/bin')}", "PYTHONPATH": str(REPO / "src")},
        worker_env=False,  # ddpkit finds each node's interface for gloo itself
    )
    logs = "\n\n".join(f"--- {r.node.name} rc={r.returncode} timed_out={r.timed_out}\n{r.output}" for r in runs)
    assert all(r.returncode == 0 for r in runs), logs
    # met through the sealed c10d rendezvous on node 0's address, not the static one
    config = json.loads((run_dir / "config.json").read_text())
    assert (config["rdzv_endpoint"], config["master_addr"]) == (f"{two_nodes.nodes[0].ip}:29500", None), config
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["nnodes"] == 2, summary
    reference = reference_run("--nproc", "2", "--quiet", *TRAIN)
    assert_state_close(load_model(run_dir), load_model(reference), rtol=1e-6, atol=1e-7)
