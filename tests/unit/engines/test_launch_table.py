"""One job description (config/launch.py, engines/job.py): a config file's [launch] table is
checked key by key, the engine's flags win over it, `ddpkit train` ignores it, and a job on
several nodes is refused a run directory on a disk of one machine."""

import pytest

from ddpkit.cli import main
from ddpkit.config.file import read_config_file, read_launch_table
from ddpkit.config.launch import LaunchTable, time_limit_s
from ddpkit.engines.job import LOCAL_FILE_SYSTEMS, check_run_dir_shared, file_system_of, job_description, run_dir_of
from ddpkit.errors import DdpkitError

JOB = """\
epochs = 2
batch_size = 16

[launch]
nodes = 2
gpus_per_node = 0
workers_per_node = 2
time = "00:30:00"
partition = "debug"
memory = "4GiB"
job_name = "wine2"
"""


def write(tmp_path, text, name="job.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_table_is_read_and_the_training_settings_ignore_it(tmp_path):
    path = write(tmp_path, JOB)
    table = read_launch_table(path)
    assert (table.nodes, table.workers_per_node, table.time, table.partition) == (2, 2, "00:30:00", "debug")
    assert table.time_limit_s == 1800
    assert read_config_file(path) == {"epochs": 2, "batch_size": 16}  # what `ddpkit train --config` takes


def test_a_file_without_the_table_describes_an_empty_job(tmp_path):
    assert read_launch_table(write(tmp_path, "epochs = 1\n")) == LaunchTable()


@pytest.mark.parametrize(
    "text, said",
    [
        ("[launch]\nnode = 2\n", "unknown key launch.node (did you mean 'nodes'?)"),
        ('[launch]\nnodes = "two"\n', "launch.nodes must be an integer, got 'two'"),
        ("[launch]\nnodes = 0\n", "[launch] nodes must be at least 1, got 0"),
        ("[launch]\nshared_run_dir = 1\n", "launch.shared_run_dir must be true or false, got 1"),
        ('[launch]\ntime = "soon"\n', "time 'soon' is not a time limit"),
        ('[launch]\nmemory = "lots"\n', "[launch] memory must be a size"),
        ("launch = 3\n", "[launch] must be a table of KEY = VALUE, got int"),
    ],
)
def test_a_wrong_key_or_value_is_named_with_the_file(tmp_path, text, said):
    path = write(tmp_path, text)
    with pytest.raises(DdpkitError) as e:
        read_launch_table(path)
    assert said in str(e.value) and str(path) in str(e.value)
    with pytest.raises(DdpkitError):  # `ddpkit train --config` refuses the same file: one file, one check
        read_config_file(path)


@pytest.mark.parametrize(
    "text, seconds",
    [("30", 1800), ("10:30", 630), ("04:00:00", 14400), ("1-00", 86400), ("2-01:30", 178200), ("1-00:00:05", 86405)],
)
def test_time_limits_are_read_as_slurm_reads_them(text, seconds):
    assert time_limit_s(text) == seconds


def test_the_flags_given_win_over_the_table_and_those_left_out_do_not(tmp_path):
    job = job_description(str(write(tmp_path, JOB)), nodes=3, time=None, partition=None)
    assert (job.nodes, job.time, job.partition) == (3, "00:30:00", "debug")
    assert job_description(None, nodes=None) == LaunchTable()


def test_one_job_has_one_run_directory(tmp_path):
    job = LaunchTable(run_dir=str(tmp_path / "a"))
    assert run_dir_of(job, str(tmp_path / "a")) == str(tmp_path / "a")
    assert run_dir_of(LaunchTable(), None) is None
    assert run_dir_of(LaunchTable(run_dir="/mnt/runs/x"), None, local=False) == "/mnt/runs/x"
    with pytest.raises(DdpkitError, match="two run directories"):
        run_dir_of(job, str(tmp_path / "b"))


def mounts(tmp_path, kind):
    path = tmp_path / "mounts"
    path.write_text(f"/dev/sda1 / ext4 rw 0 0\nserver:/export {tmp_path / 'shared'} {kind} rw 0 0\n")
    return str(path)


def test_a_run_directory_on_a_shared_file_system_is_accepted_and_one_on_a_local_disk_refused(tmp_path):
    table = mounts(tmp_path, "nfs4")
    assert file_system_of(tmp_path / "shared" / "run" / "not-made-yet", table) == "nfs4"
    assert file_system_of(tmp_path / "elsewhere", table) == "ext4"
    two = LaunchTable(nodes=2)
    check_run_dir_shared(tmp_path / "shared" / "run", two, "SLURM", mounts=table)
    with pytest.raises(DdpkitError, match=r"is on ext4, a disk of this machine, but the SLURM job spans 2 nodes"):
        check_run_dir_shared(tmp_path / "run", two, "SLURM", mounts=table)
    check_run_dir_shared(tmp_path / "run", LaunchTable(nodes=1), "SLURM", mounts=table)  # one node: its own disk
    check_run_dir_shared(tmp_path / "run", LaunchTable(nodes=2, shared_run_dir=True), "SLURM", mounts=table)
    warned = []
    check_run_dir_shared(tmp_path / "run", two, "SLURM", dry_run=True, warn=warned.append, mounts=table)
    assert len(warned) == 1 and warned[0].startswith("ddpkit: warning: the run directory")


def test_ddpkit_slurm_writes_the_job_the_table_describes_with_its_flags_on_top(tmp_path, capsys):
    path = write(tmp_path, JOB)
    argv = ["slurm", "--dry-run", "--shared-run-dir", "--config", str(path), "--time", "01:00:00", "--", "wine"]
    assert main([*argv, "--run-dir", str(tmp_path / "run")]) == 0
    script = capsys.readouterr().out
    for line in ("--nodes=2", "--ntasks-per-node=2", "--time=01:00:00", "--partition=debug", "--mem=4096M"):
        assert f"#SBATCH {line}" in script.splitlines()
    assert "#SBATCH --job-name=wine2" in script


def test_ddpkit_slurm_refuses_a_multi_node_job_whose_run_directory_is_on_this_machines_disk(tmp_path, capsys):
    assert file_system_of(tmp_path) in LOCAL_FILE_SYSTEMS  # the precondition: pytest's tmp_path is a local disk
    path = write(tmp_path, JOB)
    run = tmp_path / "run"
    code = main(
        ["slurm", "--config", str(path), "--script", str(tmp_path / "s.sbatch"), "--", "wine", "--run-dir", str(run)]
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "spans 2 nodes" in err[0] and "--shared-run-dir" in err[0]
    assert not (tmp_path / "s.sbatch").exists() and not run.exists()  # nothing written


def test_two_run_directories_for_one_slurm_job_are_refused(tmp_path, capsys):
    path = write(tmp_path, JOB.replace("[launch]\n", f'[launch]\nrun_dir = "{tmp_path / "a"}"\n'))
    argv = [
        "slurm",
        "--dry-run",
        "--shared-run-dir",
        "--config",
        str(path),
        "--",
        "wine",
        "--run-dir",
        str(tmp_path / "b"),
    ]
    assert main(argv) == 2
    assert "two run directories" in capsys.readouterr().err
