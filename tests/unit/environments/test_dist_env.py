"""DistEnv.detect: this process's place in the job from the launcher's variables."""

import pytest

from ddpkit import DdpkitError, DistEnv


def test_no_launcher_means_one_process():
    env = DistEnv.detect({})
    assert (env.rank, env.world_size, env.launcher, env.distributed) == (0, 1, "single", False)


def test_torchrun_variables_are_read():
    env = DistEnv.detect(
        {
            "RANK": "5",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "8",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "2",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29400",
        }
    )
    assert env == DistEnv(
        rank=5,
        local_rank=1,
        node_rank=2,
        world_size=8,
        local_world_size=2,
        master_addr="10.0.0.1",
        master_port=29400,
        launcher="torchrun",
    )
    assert env.nnodes == 4 and not env.is_main


def test_node_rank_is_derived_when_the_launcher_gives_none():
    env = DistEnv.detect(
        {
            "RANK": "3",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "h",
            "MASTER_PORT": "1",
        }
    )
    assert env.node_rank == 1


@pytest.mark.parametrize(
    "environ, fragment",
    [
        ({"LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "RANK, MASTER_ADDR, MASTER_PORT not set"),
        ({"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "inconsistent"),
        ({"RANK": "x", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "not an integer"),
    ],
)
def test_broken_launcher_environment_is_refused(environ, fragment):
    with pytest.raises(DdpkitError, match=fragment):
        DistEnv.detect(environ)
