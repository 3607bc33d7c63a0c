"""`ddpkit slurm`'s decisions (engines/slurm.py): no training argument or config-file
setting may say where the workers run, in any spelling of its flag; the list of those flags
is made from the settings' own spellings, not copied."""

import pytest

from ddpkit.cli import main
from ddpkit.config.file import FIELDS
from ddpkit.engines.slurm import SLURM_PLACES, placement_flags

REFUSAL = (
    "ddpkit: error: {flag} does not belong after --: SLURM starts the workers "
    "(use --nodes / --gpus-per-node / --ntasks-per-node of `ddpkit slurm`)"
)


def test_the_refused_flags_are_every_spelling_of_the_placement_settings():
    flags = placement_flags()
    assert flags[:2] == ("--nproc", "--nproc-per-node")  # the order the first given one is named in
    for name in SLURM_PLACES:
        f = FIELDS[name]
        assert (f.metadata.get("flag") or "--" + name.replace("_", "-")) in flags
        assert set(f.metadata["aliases"]) <= set(flags)
    assert {"--nproc_per_node", "--node_rank", "--master_addr", "--master_port", "--rdzv_endpoint"} <= set(flags)


@pytest.mark.parametrize("flag", placement_flags())
def test_each_spelling_after_the_dashes_is_refused_by_name(tmp_path, capsys, flag):
    value = "1" if flag in ("--nnodes", "--node-rank", "--node_rank") else "2"
    if "addr" in flag or "endpoint" in flag:
        value = "host:29500" if "endpoint" in flag else "host"
    argv = ["slurm", "--dry-run", "--", "wine", "--run-dir", str(tmp_path / "r"), f"{flag}={value}"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [REFUSAL.format(flag=flag)]


def test_the_first_placement_flag_in_the_order_is_named(tmp_path, capsys):
    assert main(["slurm", "--dry-run", "--", "wine", "--master-port", "3", "--nnodes", "2"]) == 2
    assert capsys.readouterr().err.strip() == REFUSAL.format(flag="--nnodes")


def test_invalid_training_arguments_are_refused_before_the_job_is_written(tmp_path, capsys):
    assert main(["slurm", "--script", str(tmp_path / "s.sbatch"), "--", "wine", "--bogus"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "ddpkit: error: unrecognized arguments: --bogus (see ddpkit --help)",
        "ddpkit: error: the arguments after -- are not valid `ddpkit train` arguments (see the message above)",
    ]
    assert not (tmp_path / "s.sbatch").exists()


def test_the_script_is_written_with_the_run_dir_and_the_training_arguments(tmp_path, capsys):
    script, run_dir = tmp_path / "s.sbatch", tmp_path / "rd"
    assert main(["slurm", "--script", str(script), "--", "wine", "--epochs", "3", "--run-dir", str(run_dir)]) == 0
    assert capsys.readouterr().out == f"ddpkit: wrote {script}; submit it with: sbatch {script}\n"
    text = script.read_text()
    assert "--epochs 3" in text and str(run_dir) in text and run_dir.is_dir()
