"""A real 2-node SLURM cluster (Debian's slurm-wlm, started by the fixture) runs the script
`ddpkit slurm` writes. Results must equal a single-node run with the same world size.

Bit for bit only where the arithmetic is the same: every run here pins `--threads 1`
(by default a SLURM task gets its node's cores, a local process cores / processes, and
matrix kernels may round differently at another thread count on some CPUs), and a local
reference for a 2-node job sums gradients through gloo (`--grad-sync backend`), as the
job does between its nodes."""

import json
import sys

import pytest

from conftest import REPO, assert_state_equal, load_model, run_ddpkit
from ddpkit.environments.slurm import expand_nodelist

pytestmark = pytest.mark.cluster


def _slurm_env(slurm):
    return {**slurm.env, "PYTHONPATH": str(REPO / "src")}


SAME_ARITHMETIC = ["--threads", "1"]  # in the job and in its local reference
# the job of the first two tests, and their shared local reference (gloo, 1 thread per rank)
TRAIN = ["wine", "--epochs", "6", "--batch-size", "16", "--seed", "4", "--save-every", "3", *SAME_ARITHMETIC]


def _local_reference(reference_run):
    return reference_run("--nproc", "2", "--quiet", "--grad-sync", "backend", *TRAIN[1:])


@pytest.mark.parametrize("nodelist", ["gpu[01-04,07],cpu-a1", "rack[1-2]-node[01-02]", "n[098-101]", "node[1-2] node7"])
def test_our_nodelist_parser_agrees_with_scontrol(slurm, nodelist):
    # scontrol reads the cluster's slurm.conf first (without one it refuses), so it runs against the fixture's
    assert slurm.scontrol("show", "hostnames", nodelist).split() == expand_nodelist(nodelist)


def test_generated_script_trains_on_two_nodes_like_one_node(slurm, tmp_path, reference_run):
    ref = _local_reference(reference_run)
    run_dir = tmp_path / "job"
    # the job from a config file's [launch] table; the nodes are one machine, so the run
    # directory on its disk is shared: the table says so (else a 2-node job is refused it)
    job = tmp_path / "job.toml"
    job.write_text('[launch]\nnodes = 2\njob_name = "two-nodes"\nshared_run_dir = true\n')
    proc = run_ddpkit(
        "slurm",
        "--config",
        str(job),
        "--submit",
        "--wait",
        "--wait-timeout",
        "150",
        "--",
        *TRAIN,
        "--run-dir",
        str(run_dir),
        cwd=tmp_path,
        env=_slurm_env(slurm),
        timeout=200,
        check=False,
    )
    log = next(run_dir.glob("slurm-*.out"), None)
    assert proc.returncode == 0, proc.stdout + proc.stderr + (log.read_text() if log else "no log")
    assert "ddpkit: submitted job" in proc.stdout and str(run_dir / "slurm-") in proc.stdout
    assert "COMPLETED" in proc.stdout
    script = (run_dir / "job.sbatch").read_text()
    assert script.count("srun --kill-on-bad-exit=1") == 1
    assert "#SBATCH --nodes=2" in script and "#SBATCH --job-name=two-nodes" in script
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["world_size"], summary["nnodes"], summary["grad_sync"]) == (2, 2, "gloo"), summary
    assert json.loads((ref / "summary.json").read_text())["grad_sync"] == "gloo"  # the same gradient path
    assert "world size   2 (2 nodes)" in log.read_text()
    assert_state_equal(load_model(run_dir), load_model(ref))
    # the job token: made private at submit, named (not held) by the script, in no other file or output
    token_file = run_dir / "job-token"
    assert token_file.stat().st_mode & 0o777 == 0o600
    assert (
        f"token_file={token_file}\n" in script
        and 'export DDPKIT_JOB_TOKEN_FILE="${DDPKIT_JOB_TOKEN_FILE-$token_file}"' in script
    )
    token = token_file.read_text().strip().encode()
    assert len(token) >= 40 and token not in (proc.stdout + proc.stderr).encode()
    assert [p for p in run_dir.rglob("*") if p.is_file() and p != token_file and token in p.read_bytes()] == []


def test_two_tasks_on_one_node_sum_gradients_in_shared_memory(slurm, tmp_path, reference_run):
    # srun starts both tasks on one node: ddpkit sees one machine and uses /dev/shm, and the
    # model equals a local 2-process gloo run bit for bit (2 ranks: x/2 + y/2 either way)
    ref = _local_reference(reference_run)
    run_dir = tmp_path / "job"
    proc = run_ddpkit(
        "slurm",
        "--nodes",
        "1",
        "--ntasks-per-node",
        "2",
        "--cpus-per-task",
        "1",
        "--job-name",
        "one-node",
        "--submit",
        "--wait",
        "--wait-timeout",
        "150",
        "--",
        *TRAIN,
        "--run-dir",
        str(run_dir),
        cwd=tmp_path,
        env=_slurm_env(slurm),
        timeout=200,
        check=False,
    )
    log = next(run_dir.glob("slurm-*.out"), None)
    assert proc.returncode == 0, proc.stdout + proc.stderr + (log.read_text() if log else "no log")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["world_size"], summary["nnodes"], summary["grad_sync"]) == (2, 1, "shm"), summary
    assert_state_equal(load_model(run_dir), load_model(ref))


def test_a_batch_script_without_srun_on_two_nodes_is_refused(slurm, tmp_path):
    script = tmp_path / "bare.sbatch"
    script.write_text(
        f"#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --output={tmp_path}/bare-%j.out\n"
        f"{sys.executable} -m ddpkit train --epochs 1 --run-dir {tmp_path}/r\n"
    )
    job = slurm.submit(script, cwd=tmp_path, env={"PYTHONPATH": str(REPO / "src")})
    result = slurm.wait(job, timeout=90)
    log = next(tmp_path.glob("bare-*.out")).read_text()
    assert result.state == "FAILED" and result.exit_code == 2, (result, log)
    assert "has 2 nodes but ddpkit runs in the batch script itself" in log and "srun" in log


def test_a_job_the_cluster_cannot_place_is_refused_before_it_is_submitted(slurm, tmp_path):
    # sbatch itself would queue some of these for ever (a job bigger than its partition pends
    # as "PartitionNodeLimit"): ddpkit asks sinfo first, says why in one line and writes nothing
    jobs_before = slurm.scontrol("show", "job").count("JobId=")
    for flags, said in (
        (["--partition", "nope"], "--partition nope: this cluster has no such partition (it has: debug)"),
        (["--nodes", "9"], "--nodes 9: partition debug has"),
    ):
        run_dir = tmp_path / flags[1]
        proc = run_ddpkit(
            "slurm", *flags, "--shared-run-dir", "--submit", "--", "wine", "--run-dir", str(run_dir),
            cwd=tmp_path, env=_slurm_env(slurm), timeout=60, check=False,
        )  # fmt: skip
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(err) == 1 and said in err[0], proc.stdout + proc.stderr
        assert not run_dir.exists()
    assert slurm.scontrol("show", "job").count("JobId=") == jobs_before  # nothing was submitted
