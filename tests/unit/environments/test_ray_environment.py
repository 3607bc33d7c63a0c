"""A Ray Train worker as ddpkit sees it: the variables Ray Train sets in a TorchTrainer's workers
(as printed by a real 2-worker TorchTrainer of ray 2.60), its place in the registry's order, and
what it refuses (`ddpkit launch` in each worker)."""

import pytest

from ddpkit import DdpkitError, DistEnv
from ddpkit.environments.ray import Ray
from ddpkit.environments.registry import named
from ddpkit.environments.torchelastic import TorchElastic

# A TorchTrainer's worker 1 of 4, on its second node (2 workers per node), as Ray Train sets them
RAY_WORKER = {
    "RAY_RAYLET_PID": "9595",
    "RAY_JOB_ID": "01000000",
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "NODE_RANK": "1",
    "MASTER_ADDR": "10.0.0.7",
    "MASTER_PORT": "53975",
    "OMP_NUM_THREADS": "1",
}


def test_a_ray_train_worker_is_placed_by_ray_not_by_torchrun():
    env = DistEnv.detect(RAY_WORKER)
    assert env.launcher == "ray" and env.environment is named("ray")
    assert (env.rank, env.local_rank, env.node_rank, env.world_size, env.local_world_size) == (3, 1, 1, 4, 2)
    assert (env.master_addr, env.master_port, env.nnodes) == ("10.0.0.7", 53975, 2)
    assert env.outside_launcher and not env.environment.launch_inside  # each Ray worker is one worker
    assert TorchElastic().detect(RAY_WORKER)  # torch's variables are there too: the order decides


@pytest.mark.parametrize(
    "environ, launcher",
    [
        ({k: v for k, v in RAY_WORKER.items() if k != "RAY_RAYLET_PID"}, "torchrun"),  # not a Ray process
        ({**RAY_WORKER, "TORCHELASTIC_RUN_ID": "x", "GROUP_RANK": "1"}, "torchrun"),  # torchrun inside a Ray task
        ({"RAY_RAYLET_PID": "1", "RAY_JOB_ID": "02000000"}, "single"),  # a plain Ray task: ddpkit starts workers
    ],
)
def test_only_a_ray_train_worker_is_taken_for_one(environ, launcher):
    assert DistEnv.detect(environ).launcher == launcher


def test_node_rank_and_master_have_defaults_the_group_does_not_need():
    e = {"RAY_RAYLET_PID": "1", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    assert Ray().fields(e) == dict(
        rank=1, local_rank=1, node_rank=0, world_size=2, local_world_size=2, master_addr="127.0.0.1", master_port=0
    )


def test_inconsistent_ranks_are_refused_in_one_line():
    with pytest.raises(DdpkitError, match="inconsistent Ray Train environment: RANK=4"):
        Ray().fields({**RAY_WORKER, "RANK": "4"})
    with pytest.raises(DdpkitError, match="LOCAL_WORLD_SIZE='two' is not an integer"):
        Ray().fields({**RAY_WORKER, "LOCAL_WORLD_SIZE": "two"})


def test_ddpkit_env_names_the_ray_job():
    ray = Ray()
    assert ray.details(RAY_WORKER) == {"ray_job_id": "01000000"}
    assert ray.report_lines(ray.details(RAY_WORKER)) == ["  ray         job 01000000"]
    assert ray.details({"RAY_JOB_ID": "01000000"}) == {}  # not a Train worker: nothing to show
