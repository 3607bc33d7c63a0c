"""`srun ddpkit check` in a real 2-node SLURM allocation: one table from rank 0, the node
pair measured, and the job's exit status is the verdict."""

import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.cluster


def test_srun_ddpkit_check_on_two_nodes(slurm, tmp_path):
    script = tmp_path / "check.sbatch"
    script.write_text(
        f"#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --output={tmp_path}/check-%j.out\n"
        f"srun --kill-on-bad-exit=1 {sys.executable} -m ddpkit check --run-dir {tmp_path}/runs --timeout 60\n"
    )
    job = slurm.submit(script, cwd=tmp_path, env={"PYTHONPATH": str(REPO / "src")})
    result = slurm.wait(job, timeout=120)
    log = next(tmp_path.glob("check-*.out")).read_text()
    assert result.state == "COMPLETED" and result.exit_code == 0, (result, log)
    assert log.count("ddpkit check: 2 rank(s) on 2 node(s)") == 1, log  # rank 0 alone prints
    assert "<-> " in log and "run directory  OK" in log, log
    assert "verdict: a job would run here" in log, log
