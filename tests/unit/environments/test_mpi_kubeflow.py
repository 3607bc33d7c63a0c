"""Where am I under MPI (Open MPI, MPICH / Intel MPI's Hydra) and in Kubeflow jobs, from the
exact variables each documents (Open MPI's as the real mpirun 4.1 sets them, see
tests/distributed/test_mpi.py), and the refusal of a world ddpkit cannot complete (issue 15)."""

import pytest

from ddpkit import DdpkitError, DistEnv
from ddpkit.tools.doctor import collect, format_report

# one rank of `mpirun -np 4` on one host (Open MPI 4.1.4, copied from a real run)
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "3",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    "OMPI_COMM_WORLD_NODE_RANK": "3",
    "OMPI_MCA_ess_base_jobid": "1971322881",
    "OMPI_MCA_orte_hnp_uri": "1971322880.0;tcp://192.0.2.2:56229",
    "PMIX_NAMESPACE": "1971322881",
    "PMIX_RANK": "3",
}
# MPICH / Intel MPI (Hydra): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS
MPICH = {
    "PMI_RANK": "5",
    "PMI_SIZE": "8",
    "MPI_LOCALRANKID": "1",
    "MPI_LOCALNRANKS": "4",
    "PMI_FD": "6",
    "MASTER_ADDR": "10.1.0.7",
    "MASTER_PORT": "29500",
}
# a PyTorchJob (Kubeflow training-operator) worker pod, one process per pod
PYTORCHJOB = {
    "MASTER_ADDR": "mnist-master-0",
    "MASTER_PORT": "23456",
    "WORLD_SIZE": "3",
    "RANK": "2",
    "PYTHONUNBUFFERED": "0",
}
# Kubeflow Trainer's torch runtime: variables for torchrun in the pod
TRAINER = {
    "PET_NNODES": "2",
    "PET_NPROC_PER_NODE": "2",
    "PET_NODE_RANK": "0",
    "PET_MASTER_ADDR": "job-node-0-0.job",
    "PET_MASTER_PORT": "29400",
    "JOB_COMPLETION_INDEX": "0",
}


def test_open_mpi_on_one_host_meets_on_loopback_at_a_port_of_the_job():
    env = DistEnv.detect(OPENMPI)
    assert (env.launcher, env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank) == (
        "mpi",
        3,
        3,
        4,
        4,
        0,
    )
    assert env.master_addr == "127.0.0.1"
    other_rank = DistEnv.detect({**OPENMPI, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0"})
    assert 15000 <= env.master_port < 35000 and other_rank.master_port == env.master_port
    other_job = DistEnv.detect({**OPENMPI, "OMPI_MCA_orte_hnp_uri": "1971400000.0;tcp://192.0.2.2:1"})
    assert other_job.master_port != env.master_port
    assert DistEnv.detect({**OPENMPI, "MASTER_PORT": "29555"}).master_port == 29555


def test_mpich_and_intel_mpi_across_nodes_with_the_master_named():
    env = DistEnv.detect(MPICH)
    assert (
        env.launcher,
        env.rank,
        env.local_rank,
        env.world_size,
        env.local_world_size,
        env.node_rank,
        env.nnodes,
    ) == ("mpi", 5, 1, 8, 4, 1, 2)
    assert (env.master_addr, env.master_port) == ("10.1.0.7", 29500)


def test_mpi_across_nodes_without_a_master_or_a_port_is_refused_with_the_fix():
    with pytest.raises(DdpkitError, match="MASTER_ADDR is not set.*mpirun -x MASTER_ADDR"):
        DistEnv.detect({k: v for k, v in MPICH.items() if k != "MASTER_ADDR"})
    one_host = {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    with pytest.raises(DdpkitError, match="MASTER_PORT"):
        DistEnv.detect(one_host)
    with pytest.raises(DdpkitError, match="MPI_LOCALRANKID is not set"):
        DistEnv.detect({"PMI_RANK": "0", "PMI_SIZE": "2", "PMI_KVSNAME": "kvs_1"})


def test_a_pytorchjob_pod_is_one_worker_of_the_job():
    env = DistEnv.detect(PYTORCHJOB)
    assert (env.launcher, env.rank, env.local_rank, env.world_size, env.local_world_size) == ("kubeflow", 2, 0, 3, 1)
    assert (env.master_addr, env.master_port, env.nnodes) == ("mnist-master-0", 23456, 3)
    with pytest.raises(DdpkitError, match="MASTER_PORT is not"):
        DistEnv.detect({k: v for k, v in PYTORCHJOB.items() if k != "MASTER_PORT"})


def test_a_world_ddpkit_cannot_complete_is_refused_not_run_alone():
    with pytest.raises(DdpkitError, match="PET_NNODES.*ddpkit launch"):
        DistEnv.detect_worker(TRAINER)
    with pytest.raises(DdpkitError, match="PET_NNODES.*ddpkit launch"):  # a PyTorchJob pod meant to start 2 processes
        DistEnv.detect_worker({**PYTORCHJOB, "PET_NPROC_PER_NODE": "2"})
    with pytest.raises(DdpkitError, match="WORLD_SIZE=4 is set but not RANK"):
        DistEnv.detect_worker({"WORLD_SIZE": "4"})
    assert DistEnv.detect_worker({"WORLD_SIZE": "1"}).launcher == "single"
    assert DistEnv.detect(TRAINER).launcher == "single"  # the launcher in the pod itself reads PET_* as its flags


@pytest.mark.parametrize(
    "environ, shown",
    [
        (OPENMPI, "MPI (openmpi"),
        (MPICH, "MPI (mpich"),
        (PYTORCHJOB, "Kubeflow PyTorchJob pod"),
        (TRAINER, "PET_NNODES=2 PET_NODE_RANK=0"),
    ],
)
def test_ddpkit_env_says_which_it_found(environ, shown):
    text = format_report(collect(environ))
    assert shown in text


@pytest.mark.parametrize("environ", [OPENMPI, PYTORCHJOB])
def test_ddpkit_launch_inside_an_mpi_or_pytorchjob_world_is_refused_not_run_n_times(monkeypatch, tmp_path, environ):
    from ddpkit.launchers.script import launch

    for k, v in environ.items():
        monkeypatch.setenv(k, v)
    script = tmp_path / "s.py"
    script.write_text("")
    with pytest.raises(DdpkitError, match="already started this job's .* independent jobs"):
        launch([str(script)])
