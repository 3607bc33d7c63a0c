import shlex

import pytest

from ddpkit import DdpkitError, DistEnv, RunConfig
from ddpkit.engines.sbatch import SlurmJob, render_sbatch
from ddpkit.environments.slurm import expand_nodelist, expand_tasks_per_node, port_for_job
from ddpkit.run.train import check_request_matches_launcher


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node1", ["node1"]),
        ("node1,node2", ["node1", "node2"]),
        ("gpu[01-04,07],cpu-a1", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu-a1"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        ("a[1,3],b[2-3].ib", ["a1", "a3", "b2.ib", "b3.ib"]),
        ("x[5]", ["x5"]),
        ("host-1.example.org", ["host-1.example.org"]),
        ("node[1-2] node7", ["node1", "node2", "node7"]),
    ],
)
def test_nodelists_expand_like_slurm(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["n[1-", "n1-2]", "n[a-b]", "n[5-2]"])
def test_malformed_nodelists_are_refused(bad):
    with pytest.raises(DdpkitError, match="nodelist"):
        expand_nodelist(bad)


def test_tasks_per_node_and_port():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    assert port_for_job(123) != port_for_job(124) and 1024 < port_for_job(987654) < 65536


SRUN_TASK = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "2",
    "SLURM_NTASKS": "8",
    "SLURM_TASKS_PER_NODE": "2(x4)",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_JOB_NODELIST": "gpu[01-04]",
}


def test_srun_task_environment_gives_the_ranks():
    env = DistEnv.detect(SRUN_TASK)
    assert env == DistEnv(
        rank=5,
        local_rank=1,
        node_rank=2,
        world_size=8,
        local_world_size=2,
        master_addr="gpu01",
        master_port=port_for_job(4242),
        launcher="slurm",
    )
    assert env.nnodes == 4
    assert DistEnv.detect({**SRUN_TASK, "MASTER_PORT": "29999", "MASTER_ADDR": "10.1.1.1"}).master_port == 29999


def test_torchrun_variables_win_over_slurm():
    env = DistEnv.detect(
        {**SRUN_TASK, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    )
    assert env.launcher == "torchrun" and env.world_size == 2


def test_batch_script_on_several_nodes_without_srun_is_refused():
    batch = {
        "SLURM_JOB_ID": "1",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "0",
        "SLURM_JOB_NODELIST": "n[1-2]",
    }
    with pytest.raises(DdpkitError, match="srun --kill-on-bad-exit=1"):
        DistEnv.detect(batch)
    assert DistEnv.detect({**batch, "SLURM_JOB_NUM_NODES": "1"}).launcher == "single"  # one node: ddpkit spawns


def test_one_task_allocation_lets_ddpkit_start_the_workers():
    env = DistEnv.detect({**SRUN_TASK, "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_JOB_NUM_NODES": "1"})
    assert env.launcher == "single"


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(nproc=4), "srun already started 2 process(es) on this node"),
        (dict(nnodes="2"), "--nnodes 2 but srun started this job on 4 node(s)"),
    ],
)
def test_requests_that_disagree_with_srun_are_refused(kwargs, fragment):
    env = DistEnv.detect(SRUN_TASK)
    with pytest.raises(DdpkitError) as e:
        check_request_matches_launcher(
            RunConfig(**kwargs, master_addr="x", node_rank=0) if "nnodes" in kwargs else RunConfig(**kwargs), env
        )
    assert fragment in str(e.value)
    check_request_matches_launcher(RunConfig(nproc=2), env)  # agreeing is fine


def test_sbatch_script_quotes_every_user_value():
    job = SlurmJob(
        train_args=["wine", "--run-dir", "/tmp/x; rm -rf ~", "--lr", "$(reboot)"],
        nodes=2,
        gpus_per_node=4,
        run_dir="/tmp/safe",
        time="01:00:00",
        partition="gpu",
    )
    text = render_sbatch(job)
    srun_line = next(line for line in text.splitlines() if line.startswith("srun "))
    argv = shlex.split(srun_line.removesuffix(" || status=$?"))
    assert argv[:2] == ["srun", "--kill-on-bad-exit=1"]
    assert "/tmp/x; rm -rf ~" in argv and "$(reboot)" in argv  # arguments, never shell code
    assert "--auto-resume" in argv and argv[argv.index("--save-on-signal") + 1] == "USR2,TERM"
    assert "#SBATCH --ntasks-per-node=4" in text and "#SBATCH --gpus-per-node=4" in text
    assert "#SBATCH --signal=USR2@90" in text and "#SBATCH --requeue" in text
    assert "$SLURM_NODEID" not in text  # nothing per-node to expand: ddpkit reads it on each node


def test_the_batch_script_requeues_after_the_warning_from_the_batch_host():
    text = render_sbatch(SlurmJob(train_args=["wine"], run_dir="/tmp/my run", output="/tmp/log-%j.out"))
    lines = text.splitlines()
    assert 'export DDPKIT_REQUEUE_FILE="$RUN_DIR/requeue-request"' in lines and "RUN_DIR='/tmp/my run'" in lines
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert lines[srun - 2 : srun] == [
        'mkdir -p "$RUN_DIR" && rm -f "$DDPKIT_REQUEUE_FILE"',
        "status=0",
    ]  # no stale request
    assert lines[srun].endswith(" || status=$?")  # a failed srun still reaches the check below
    assert lines[srun + 1 :] == [
        'if [ -e "$DDPKIT_REQUEUE_FILE" ]; then',
        '    rm -f "$DDPKIT_REQUEUE_FILE"',
        '    echo "ddpkit: requeueing SLURM job $SLURM_JOB_ID"',
        # an array element by ARRAY_INDEX: its JobId may be the array's, which would requeue every element
        '    scontrol requeue "${SLURM_ARRAY_TASK_ID:+${SLURM_ARRAY_JOB_ID}_}${SLURM_ARRAY_TASK_ID:-$SLURM_JOB_ID}"',
        "fi",
        'exit "$status"',
    ]
    plain = render_sbatch(SlurmJob(train_args=["wine"], run_dir="/tmp/r", signal=""))
    assert "DDPKIT_REQUEUE_FILE" not in plain and "requeue" not in plain.split("#SBATCH --requeue")[1]


def test_each_element_of_an_array_has_its_own_run_dir_and_log():
    text = render_sbatch(SlurmJob(train_args=["wine", "--run-dir", "/tmp/r"], run_dir="/tmp/r", array="0-3%2"))
    assert "#SBATCH --array=0-3%2" in text and "#SBATCH --output=/tmp/r/slurm-%A_%a.out" in text
    assert any(line.startswith('RUN_DIR=/tmp/r/"$SLURM_ARRAY_TASK_ID"') for line in text.splitlines())
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert srun.endswith('--requeue --run-dir "$RUN_DIR" || status=$?')  # the last --run-dir wins


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(signal="TERM@60"), "cannot ask for a requeue"),
        (dict(array="0-3;reboot"), "--array"),
        (dict(partition="gpu;reboot"), "--partition"),
        (dict(job_name="a b"), "--job-name"),
        (dict(time="tomorrow"), "--time"),
        (dict(gpus_per_node=2, tasks_per_node=4), "one task per GPU"),
        (dict(nodes=0), "--nodes"),
        (dict(output="/tmp/with space/%j.out"), "space"),
    ],
)
def test_bad_slurm_requests_are_refused(kwargs, fragment):
    with pytest.raises(DdpkitError, match=fragment):
        render_sbatch(SlurmJob(train_args=["wine"], run_dir="/tmp/r", **kwargs))
