"""The environments as one ordered list: which launcher is asked first, what each reads from
a given set of variables, and what each says about the run (who started it, GPU binding)."""

import pytest

from ddpkit import DdpkitError, DistEnv
from ddpkit.environments import ENVIRONMENTS, Environment
from ddpkit.environments.kubeflow import Kubeflow
from ddpkit.environments.local import Local
from ddpkit.environments.mpi import Mpi
from ddpkit.environments.registry import named
from ddpkit.environments.slurm import Slurm, port_for_job
from ddpkit.environments.torchelastic import TorchElastic

TORCHRUN = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29400",
}
SRUN = {
    "SLURM_JOB_ID": "77",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_JOB_NODELIST": "10.0.0.[5-6]",
}
BATCH = {"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "10.0.0.5"}
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "MASTER_ADDR": "10.0.0.9",
    "MASTER_PORT": "29501",
}
POD = {"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}


def test_the_registry_asks_ray_and_torchrun_first_and_ends_with_the_one_that_always_detects():
    assert [e.name for e in ENVIRONMENTS] == ["ray", "torchrun", "slurm", "mpi", "kubeflow", "skypilot", "single"]
    assert all(isinstance(e, Environment) for e in ENVIRONMENTS)
    assert ENVIRONMENTS[-1].detect({}) and not any(e.detect({}) for e in ENVIRONMENTS[:-1])
    # only the last lets ddpkit start the workers; every other one started them itself (SkyPilot
    # started the command on each node and places no worker: it never detects)
    assert [e.outside_launcher for e in ENVIRONMENTS] == [True, True, True, True, True, True, False]
    assert all(named(e.name) is e for e in ENVIRONMENTS) and DistEnv().environment is ENVIRONMENTS[-1]
    with pytest.raises(ValueError, match="no environment named 'dask'"):
        named("dask")


@pytest.mark.parametrize(
    "environ, first",
    [
        (
            {**SRUN, **OPENMPI, **TORCHRUN},
            "torchrun",
        ),  # torchrun inside an srun step inside an MPI job: torchrun placed it
        ({**OPENMPI, **SRUN}, "slurm"),
        ({**POD, **OPENMPI}, "mpi"),
        ({**BATCH, **OPENMPI}, "mpi"),  # SLURM's batch script on one node places nobody: the next one is asked
        (BATCH, "single"),
    ],
)
def test_the_first_environment_that_placed_this_process_wins(environ, first):
    env = DistEnv.detect(environ)
    assert env.launcher == first and env.environment is named(first)
    assert env.outside_launcher == (first != "single")


def test_torch_elastic_reads_its_variables():
    assert TorchElastic().detect(TORCHRUN) and not TorchElastic().detect(POD)  # a pod has no LOCAL_RANK
    assert TorchElastic().fields(TORCHRUN) == dict(
        rank=3, local_rank=1, node_rank=1, world_size=4, local_world_size=2, master_addr="10.0.0.1", master_port=29400
    )


def test_slurm_places_an_srun_task_but_only_names_the_batch_script():
    slurm = Slurm()
    assert slurm.detect(SRUN) and slurm.present(SRUN)
    assert slurm.present(BATCH) and not slurm.detect(BATCH)  # `ddpkit env` names it, ddpkit starts the workers
    assert not slurm.detect({**SRUN, "SLURM_NTASKS": "1", "SLURM_TASKS_PER_NODE": "1"})  # one task: ddpkit starts them
    assert slurm.fields(SRUN) == dict(
        rank=3,
        local_rank=1,
        node_rank=1,
        world_size=4,
        local_world_size=2,
        master_addr="10.0.0.5",
        master_port=port_for_job(77),
    )
    assert slurm.job_id(SRUN) == "77" and TorchElastic().job_id(TORCHRUN) is None
    with pytest.raises(DdpkitError, match="first node only"):
        slurm.check_unplaced({**BATCH, "SLURM_JOB_NUM_NODES": "2"})
    slurm.check_unplaced(BATCH)  # one node: ddpkit starts that node's workers, nothing to refuse


def test_mpi_and_a_pytorchjob_pod_read_their_variables():
    assert Mpi().detect(OPENMPI) and not Mpi().detect(POD)
    assert Mpi().fields(OPENMPI) == dict(
        rank=2, local_rank=0, node_rank=1, world_size=4, local_world_size=2, master_addr="10.0.0.9", master_port=29501
    )
    assert Kubeflow().detect(POD) and not Kubeflow().detect(TORCHRUN)
    assert Kubeflow().fields(POD) == dict(
        rank=1,
        local_rank=0,
        node_rank=1,
        world_size=3,
        local_world_size=1,
        master_addr="job-master-0",
        master_port=23456,
    )
    with pytest.raises(DdpkitError, match="WORLD_SIZE=3 is set but not RANK"):
        Kubeflow().check_alone({"WORLD_SIZE": "3"})


def test_who_started_the_processes_and_whether_ddpkit_launch_may_run_in_each():
    assert [e.starter for e in ENVIRONMENTS] == [
        "Ray Train", "torchrun", "srun", "mpirun", "the PyTorchJob", "SkyPilot", "ddpkit"
    ]  # fmt: skip
    assert [e.launch_inside for e in ENVIRONMENTS] == [False, True, True, False, False, True, True]
    assert Local().fields({}) == {} and DistEnv.detect({}) == DistEnv()


@pytest.mark.parametrize(
    "environment, local_rank, gpus, index",
    [
        (TorchElastic(), 1, 2, 1),
        (TorchElastic(), 1, 1, None),  # a second process on a node with one GPU: none left
        (Slurm(), 1, 1, 0),  # SLURM bound one GPU to each task: it is this task's
        (Slurm(), 2, 2, None),
        (Mpi(), 0, 0, None),
    ],
)
def test_gpu_binding_is_the_environments(environment, local_rank, gpus, index):
    assert environment.gpu_index(local_rank, gpus) == index


class Demo(Environment):
    """A launcher ddpkit does not know, written as a new one would be: one class."""

    name = "demo"
    starter = "the demo scheduler"

    def detect(self, e):
        return "DEMO_RANK" in e

    def fields(self, e):
        return dict(
            rank=int(e["DEMO_RANK"]),
            local_rank=0,
            node_rank=int(e["DEMO_RANK"]),
            world_size=2,
            local_world_size=1,
            master_addr="10.9.9.9",
            master_port=29000,
        )

    def title(self, report):
        return "demo scheduler (one task, one worker)"


def test_a_new_environment_in_the_list_is_what_detect_ddpkit_env_and_the_api_ask(monkeypatch):
    from ddpkit.config import RunConfig
    from ddpkit.environments import registry
    from ddpkit.run.train import check_request_matches_launcher
    from ddpkit.tools.doctor import collect, format_report

    monkeypatch.setattr(registry, "ENVIRONMENTS", (*ENVIRONMENTS[:-1], Demo(), ENVIRONMENTS[-1]))
    environ = {"DEMO_RANK": "1", "PATH": "/nonexistent"}
    env = DistEnv.detect(environ)
    assert (env.launcher, env.rank, env.world_size, env.master_addr) == ("demo", 1, 2, "10.9.9.9")
    assert env.outside_launcher and isinstance(env.environment, Demo)
    report = collect(environ)
    assert report["launcher"]["name"] == "demo" and report["launcher"]["resolved"]["rank"] == 1
    assert "detected    demo scheduler (one task, one worker)" in format_report(report)
    assert report["plan"]["how"] == "this process is rank 1 of 2 in a job started by demo"
    with pytest.raises(DdpkitError, match=r"the demo scheduler already started 1 process\(es\) on this node"):
        check_request_matches_launcher(RunConfig(nproc=4), env)
