"""`ddpkit ray`'s decisions (engines/ray.py), made before anything reaches Ray: the job from the
config file's [launch] table under the command's flags, the checks (a multi-node job's run
directory, where the workers run is Ray's), and how Ray's failure becomes ddpkit's one line."""

import pytest

from ddpkit.cli import main
from ddpkit.config.launch import LaunchTable
from ddpkit.engines.ray import REFUSED_FILE, RayJob, absolute_task, job_error, ray_job
from ddpkit.errors import DdpkitError, WorkerFailed


@pytest.mark.parametrize(
    "table, workers, expected",
    [
        (LaunchTable(), None, (1, None, "PACK")),
        (LaunchTable(), 3, (3, None, "PACK")),  # wherever Ray finds room
        (LaunchTable(nodes=1), 4, (4, 1, "STRICT_PACK")),
        (LaunchTable(nodes=2), 2, (2, 2, "STRICT_SPREAD")),  # one per node
        (LaunchTable(nodes=2, workers_per_node=2), None, (4, 2, "SPREAD")),
        (LaunchTable(nodes=2, gpus_per_node=4), None, (8, 2, "SPREAD")),  # one worker per GPU
        (LaunchTable(workers_per_node=2), 6, (6, 3, "SPREAD")),
    ],
)
def test_the_workers_and_their_placement_come_from_the_table_and_workers(table, workers, expected):
    job = ray_job(table, workers)
    assert (job.workers, job.nodes, job.placement) == expected


@pytest.mark.parametrize(
    "table, workers, message",
    [
        (LaunchTable(nodes=2, workers_per_node=2), 3, "--workers 3 but nodes x workers per node = 2 x 2 = 4"),
        (LaunchTable(nodes=2), 3, "3 worker(s) do not divide evenly over 2 node(s)"),
        (LaunchTable(nodes=4), 2, "4 node(s) for 2 worker(s)"),
        (LaunchTable(gpus_per_node=2, workers_per_node=4), None, "ddpkit runs one worker per GPU"),
        (LaunchTable(), 0, "--workers must be at least 1"),
    ],
)
def test_a_job_that_cannot_be_placed_is_refused(table, workers, message):
    with pytest.raises(DdpkitError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ray_job(table, workers)


def test_gpu_workers_ask_ray_for_a_gpu_each_and_cpus_when_given():
    job = ray_job(LaunchTable(gpus_per_node=8, cpus_per_worker=6, nodes=2), None, max_failures=3, backend="nccl")
    assert (job.workers, job.device_type, job.max_failures, job.backend) == (16, "cuda", 3, "nccl")
    assert job.resources == {"CPU": 6.0, "GPU": 1.0}
    assert RayJob(workers=2).resources is None and RayJob(workers=2).backend is None  # Ray's defaults


def _toml(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_the_launch_table_describes_the_job_and_the_flags_win(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = _toml(
        tmp_path,
        'epochs = 2\n[launch]\nnodes = 2\nworkers_per_node = 2\ncpus_per_worker = 3\naddress = "10.0.0.1:6379"\n'
        'job_name = "exp"\nshared_run_dir = true\n',
    )
    assert main(["ray", "--config", config, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "on 10.0.0.1:6379" in out and "4 worker(s) on 2 node(s) (placement SPREAD); each no GPU, 3 CPU(s)" in out
    assert f"resumes from {tmp_path}/runs/exp-" in out
    argv = ["ray", "--config", config, "--dry-run", "--address", "auto", "--nodes", "1", "--workers-per-node", "3"]
    assert main([*argv, "--", "--max-restarts", "2", "--run-dir", "r"]) == 0
    out = capsys.readouterr().out
    assert "on auto" in out and "3 worker(s) on 1 node(s) (placement STRICT_PACK)" in out
    assert f"restarts: 2 (--max-restarts); each attempt resumes from {tmp_path}/r" in out


def test_a_multi_node_job_on_a_local_disk_is_refused_in_one_line_a_dry_run_warns(tmp_path, capsys):
    run = tmp_path / "r"
    assert main(["ray", "--workers", "2", "--nodes", "2", "--", "wine", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"ddpkit: error: the run directory {run} is on ")
    assert "but the Ray job spans 2 nodes" in err[0] and "--shared-run-dir" in err[0] and not run.exists()
    assert main(["ray", "--workers", "2", "--nodes", "2", "--dry-run", "--", "wine", "--run-dir", str(run)]) == 0
    assert capsys.readouterr().err.startswith("ddpkit: warning: the run directory")


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--nproc", "2"], "--nproc"),
        (["--max-restarts", "1", "--nproc-per-node", "2"], "--nproc"),
        (["--nnodes", "2"], "--nnodes"),  # not a question of --master-addr: Ray's
        (["--rdzv-backend", "c10d"], "--rdzv-backend"),  # any setting of the node group
    ],
)
def test_where_the_workers_run_is_rays(tmp_path, capsys, argv, flag):
    assert main(["ray", "--dry-run", "--", "wine", *argv]) == 2
    assert capsys.readouterr().err.strip() == (
        f"ddpkit: error: {flag} does not belong in a Ray job: Ray places the workers (use --workers, "
        "--nodes and --workers-per-node of `ddpkit ray`, or the [launch] table)"
    )


def test_a_config_file_may_not_place_the_workers_either(tmp_path, capsys):
    assert main(["ray", "--config", _toml(tmp_path, 'master_addr = "10.0.0.1"\n'), "--dry-run"]) == 2
    assert "--master-addr does not belong in a Ray job" in capsys.readouterr().err
    after = ["--dry-run", "--", "wine", "--config", _toml(tmp_path, 'rdzv_id = "x"\n')]  # after --, as train reads it
    assert main(["ray", *after]) == 2
    assert "--rdzv-id does not belong in a Ray job" in capsys.readouterr().err


def test_a_task_in_a_file_travels_by_its_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "t.py").write_text("def task(): pass\n")
    monkeypatch.chdir(tmp_path)
    assert absolute_task("t.py:task") == f"{tmp_path}/t.py:task"
    assert absolute_task("wine") == "wine" and absolute_task("pkg.mod:fn") == "pkg.mod:fn"


def test_rays_failure_becomes_the_line_of_the_rank_that_caused_it(tmp_path):
    train = pytest.importorskip("ray.train", reason="needs Ray Train: the ray extra")
    from ray.exceptions import RayActorError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    refused = tmp_path / REFUSED_FILE
    lost = RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234")
    own = train.WorkerGroupError("...", {0: lost, 1: ValueError("no data\nmore")})
    e = job_error(own, refused, 2)
    assert type(e) is WorkerFailed and str(e) == (
        "worker rank 1 raised ValueError: no data; the other workers were stopped (after 2 restart(s), --max-restarts)"
    )
    died = WorkerHealthCheckFailedError("Worker health check failed", RayActorError())
    e = job_error(train.WorkerGroupError("...", {0: lost, 1: died}), refused, 0)
    assert type(e) is WorkerFailed and str(e).startswith("worker rank 1 died (")
    assert str(e).endswith("; the other workers were stopped")
    said = DdpkitError("--task-arg rows must be a number")
    assert job_error(train.WorkerGroupError("...", {1: said, 0: lost}), refused, 1) is said  # exit 2
    refused.write_text("the task refused its input\n")
    e = job_error(train.WorkerGroupError("...", {0: RuntimeError("x")}), refused, 1)
    assert type(e) is DdpkitError and str(e) == "the task refused its input"  # what a restart left
