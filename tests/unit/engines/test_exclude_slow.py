"""`ddpkit slurm --exclude-slow` (engines/exclude_slow.py, the script of engines/sbatch.py): which
nodes the requeued job leaves out, never so many that its partition could not run it, and the
script's order: decide before the requeue, set ExcNodeList after it, through the requeue's SIGTERM."""

import os
import subprocess
from pathlib import Path

import pytest

from ddpkit.cli import main
from ddpkit.engines.exclude_slow import decide, in_service
from ddpkit.engines.exclude_slow import main as exclude_main
from ddpkit.engines.sbatch import SlurmJob, render_sbatch
from ddpkit.errors import DdpkitError
from ddpkit.reporting.slow_nodes import SlowNodes

NAMED = {"rank": 1, "where": "compute", "ratio": 3.0}


def record(*checks):
    """A record of these checks, each the set of nodes it named."""
    r = SlowNodes()
    for step, names in enumerate(checks, 1):
        r.check({n: NAMED for n in names}, 10 * step)
    return r


PARTITION = {"gpu": {"n1", "n2", "n3", "n4"}}


def test_a_node_named_at_the_last_two_checks_is_left_out_and_said_why():
    d = decide(record({"n2"}, {"n2"}), set(), PARTITION, needed=2)
    assert (d.leave_out, d.exc_node_list) == (["n2"], "n2")
    assert d.lines == [
        "ddpkit: the requeued job leaves out node n2: named slow at the last 2 straggler checks in a row "
        "(step 10: rank 1, compute, 3.0x the median; step 20: rank 1, compute, 3.0x the median)"
    ]
    # what the job excludes already stays excluded; a node excluded already is not said again
    assert decide(record({"n2"}, {"n2"}), {"n9"}, PARTITION, 2).exc_node_list == "n2,n9"
    again = decide(record({"n2"}, {"n2"}), {"n2"}, PARTITION, 2)
    assert (again.leave_out, again.exc_node_list, again.lines) == ([], "", [])


@pytest.mark.parametrize(
    "checks",
    [({"n2"},), ({"n2"}, set()), ({"n2"}, set(), {"n2"}), ({"n2"}, {"n1"}), ()],
    ids=["once", "not-at-the-last", "not-in-a-row", "another-node", "no-checks"],
)
def test_a_node_not_named_at_the_last_two_checks_stays(checks):
    assert decide(record(*checks), set(), PARTITION, 2).exc_node_list == ""


def test_never_so_many_nodes_that_the_partition_cannot_run_the_job():
    # 4 usable nodes (n4 excluded already), a job of 2: one of the two slow nodes may go, the longer streak
    slow = record({"n2"}, {"n2", "n3"}, {"n2", "n3"})
    d = decide(slow, {"n4"}, PARTITION, needed=2)
    assert (d.leave_out, d.exc_node_list) == (["n2"], "n2,n4")
    assert d.lines[1] == (
        "ddpkit: node n3 stays in the job though named slow at the last 2 straggler checks in a row (step 20: rank 1, "
        "compute, 3.0x the median; step 30: rank 1, compute, 3.0x the median): without it the job's partition keeps "
        "fewer usable nodes than the 2 it needs (gpu: n1)"
    )
    # a job of 4 on 4 nodes: none; in one of two partitions the job may run in: yes
    assert decide(slow, set(), PARTITION, needed=4).leave_out == []
    both = {**PARTITION, "big": {f"b{i}" for i in range(8)} | {"n2", "n3"}}
    assert decide(slow, set(), both, needed=4).leave_out == ["n2", "n3"]
    unknown = decide(slow, set(), None, needed=2)  # SLURM did not answer: nothing is left out
    assert unknown.leave_out == [] and unknown.lines == [
        "ddpkit: not leaving out n2, n3: SLURM did not say which nodes the job may use"
    ]


def test_which_node_states_are_in_service():
    usable = ["idle", "allocated", "mixed", "completing", "idle~", "allocated+", "reserved", "planned"]
    out = ["down", "down*", "idle*", "drained", "draining", "fail", "failing", "maint", "unknown", "future", "drained~"]
    assert [s for s in usable if not in_service(s)] == [] and [s for s in out if in_service(s)] == []


def test_the_helper_never_stops_the_requeue(tmp_path, capsys):
    assert exclude_main([str(tmp_path / "none.json"), "7", "2"]) == 0  # no record: nothing to say
    assert capsys.readouterr() == ("", "")
    assert exclude_main(["only-two", "args"]) == 0
    assert capsys.readouterr().err.startswith("ddpkit: --exclude-slow leaves no node out: ")
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(DdpkitError, match="is not a slow-node record"):
        SlowNodes.load(tmp_path / "bad.json")
    assert exclude_main([str(tmp_path / "bad.json"), "7", "2"]) == 0


def fake_slurm(tmp_path: Path) -> dict[str, str]:
    """PATH with an `srun` that stops the workers for a requeue (rank 0's request) and an
    `scontrol` that logs its calls and, on `requeue`, sends SIGTERM to the job's processes as
    SLURM does; a `python` whose exclude_slow names gpu02."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    scripts = {
        "srun": '#!/bin/sh\necho "{}" > "$DDPKIT_REQUEUE_FILE"\n',
        "scontrol": (
            f'#!/bin/sh\necho "scontrol $*" >> {log}\n'
            '[ "$1" = show ] && echo gpu01\n'
            '[ "$1" = requeue ] && kill -TERM -"$(ps -o pgid= $$ | tr -d " ")"\n'
            "exit 0\n"
        ),
        "python": f'#!/bin/sh\necho "python $*" >> {log}\necho gpu02\n',
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "gpu[01-02]",
    }


def test_the_script_decides_before_the_requeue_and_sets_excnodelist_after_it_through_its_sigterm(tmp_path):
    job = SlurmJob(train_args=["wine"], nodes=2, run_dir=str(tmp_path / "run"), exclude_slow=True)
    job.python = str(tmp_path / "bin" / "python")
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(job))
    env = fake_slurm(tmp_path)
    done = subprocess.run(["setsid", "bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done
    calls = (tmp_path / "calls.log").read_text().splitlines()
    record = tmp_path / "run" / "slow-nodes.json"
    assert calls == [
        "scontrol show hostnames gpu[01-02]",
        f"python -m ddpkit.engines.exclude_slow {record} 7 2",
        "scontrol requeue 7",
        "scontrol update JobId=7 ExcNodeList=gpu02",  # after the requeue's SIGTERM
    ], calls
    without = render_sbatch(SlurmJob(train_args=["wine"], nodes=2, run_dir="/r"))
    assert "exclude" not in without and "trap" not in without and "DDPKIT_SLOW_NODES_FILE" not in without


def test_the_flag_and_the_launch_table_ask_for_it_and_what_it_needs_is_checked(tmp_path, capsys):
    config = tmp_path / "job.toml"
    config.write_text("[launch]\nexclude_slow = true\n")
    for ask in (["--exclude-slow"], ["--config", str(config)]):
        assert main(["slurm", "--dry-run", *ask, "--", "wine", "--run-dir", str(tmp_path / "r")]) == 0
        out = capsys.readouterr().out
        assert 'export DDPKIT_SLOW_NODES_FILE="$RUN_DIR/slow-nodes.json"' in out and "ExcNodeList=" in out
    assert main(["slurm", "--dry-run", "--exclude-slow", "--", "wine", "--straggler-every", "0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "ddpkit: error: --exclude-slow (exclude_slow in [launch]) leaves out the nodes the straggler checks name, "
        "but --straggler-every is 0: give it a number of steps after -- (e.g. --straggler-every 100)"
    )
    assert main(["slurm", "--dry-run", "--exclude-slow", "--signal", "", "--", "wine"]) == 2
    assert "keep --signal (e.g. USR2@90)" in capsys.readouterr().err
