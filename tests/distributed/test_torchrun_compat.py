"""torchrun compatibility of `ddpkit launch` (issue 15): the same script with the same torchrun
flags under both gives the same output and log files; teed lines are whole and carry their
rank; several launchers on one host share one c10d store; a rendezvous that does not
complete ends with one line."""

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, run_ddpkit

SCRIPT = str(Path(__file__).parent / "scripts" / "rank_lines.py")
ENV = {"PYTHONPATH": str(REPO / "src"), "LINES": "300"}
LINE = re.compile(r"^\[(\w+?)(\d+)\]:(rank (\d) (?:line \d+ x{300}|env .*|to stderr))$")


def _content(text: str, prefix: str) -> list[str]:
    """The lines without their prefix, checking each is whole and comes from the rank it names."""
    out = []
    for line in text.splitlines():
        if not line.startswith("["):
            continue  # torchrun's own banner
        m = LINE.match(line)
        assert m, f"a line that is not whole: {line[:120]!r}"
        assert m.group(1) == prefix and m.group(2) == m.group(4), line[:80]
        out.append(m.group(3))
    return sorted(out)


def _logs(folder: Path) -> dict[str, str]:
    return {p.parent.name + "/" + p.name: p.read_text() for p in folder.glob("*/attempt_0/*/*.log")}


def test_same_script_and_flags_under_torchrun_and_ddpkit_launch_give_the_same_output(tmp_path):
    flags = [
        "--nnodes=1",
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0",
        "--max_restarts=0",
        "--monitor_interval=0.1",
        "--tee=3",
        "--rdzv_conf=join_timeout=60",
    ]
    ours = run_ddpkit("launch", *flags, "--log_dir", str(tmp_path / "ours"), SCRIPT, "a", "--b", env=ENV)
    theirs = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *flags,
            "--log_dir",
            str(tmp_path / "theirs"),
            SCRIPT,
            "a",
            "--b",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **ENV},
    )
    assert theirs.returncode == 0, theirs.stderr
    assert _content(ours.stdout, "rank") == _content(theirs.stdout, "default")  # ddpkit's prefix is the global rank
    assert (
        _content(ours.stderr, "rank") == _content(theirs.stderr, "default") == ["rank 0 to stderr", "rank 1 to stderr"]
    )
    assert len(_content(ours.stdout, "rank")) == 602
    assert (
        _logs(tmp_path / "ours") == _logs(tmp_path / "theirs") and len(_logs(tmp_path / "ours")) == 4
    )  # per-rank files


def test_ddpkit_launch_tees_by_default_and_honours_filters_and_redirects(tmp_path):
    proc = run_ddpkit("launch", "--nproc", "2", SCRIPT, env={**ENV, "LINES": "200"})
    assert len(_content(proc.stdout, "rank")) == 402  # several local workers: whole lines, rank-prefixed, by default
    proc = run_ddpkit(
        "launch",
        "--nproc",
        "2",
        "--local-ranks-filter",
        "1",
        "--redirects",
        "2",
        "--log-dir",
        str(tmp_path),
        SCRIPT,
        env={**ENV, "LINES": "5"},
    )
    assert {line.split(" ")[1] for line in _content(proc.stdout, "rank")} == {"1"} and "to stderr" not in proc.stderr
    assert "rank 0 to stderr" in next(tmp_path.glob("*/attempt_0/0/stderr.log")).read_text()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_launchers_on_one_host_share_one_c10d_store_as_under_torchrun():
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "ddpkit",
        "launch",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "1",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"127.0.0.1:{port}",
        "--rdzv_id",
        "two",
        "--timeout",
        "60",
        SCRIPT,
    ]
    env = {**os.environ, **ENV, "LINES": "2"}
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted(o[0].splitlines()[0].split(" env")[0] for o in outs) == ["rank 0", "rank 1"]
    assert all("WORLD_SIZE=2" in o[0] for o in outs)


@pytest.mark.parametrize("kind", ["c10d", "static"])
def test_a_rendezvous_that_does_not_complete_is_one_line_naming_the_endpoint(kind):
    port = _free_port()
    where = (
        ["--rdzv-endpoint", f"127.0.0.1:{port}"]
        if kind == "c10d"  # node 1 of a static job: node 0 never comes
        else ["--node_rank", "1", "--master_addr", "127.0.0.1", "--master_port", str(port)]
    )
    t0 = time.monotonic()
    proc = run_ddpkit(
        "launch",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        *where,
        "--timeout",
        "4",
        SCRIPT,
        env=ENV,
        check=False,
        timeout=90,
    )
    assert proc.returncode == 2 and time.monotonic() - t0 < 60
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert (
        f"rendezvous at 127.0.0.1:{port} timed out" in proc.stderr and "every node runs the same command" in proc.stderr
    )


def test_a_failing_worker_exits_1_as_under_torchrun_with_one_rank_prefix_per_line():
    script = str(Path(__file__).parent / "scripts" / "fails_after_joining.py")
    flags = ["--standalone", "--nproc_per_node=2"]
    ours = run_ddpkit("launch", *flags, script, env=ENV, check=False)
    theirs = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *flags, script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **ENV},
    )
    assert theirs.returncode == 1 and ours.returncode == 1, ours.stderr  # 2 stays ddpkit's own usage errors

    def traceback_lines(text):
        return [line for line in text.splitlines() if line.startswith("[rank0]: ")]

    lines = traceback_lines(ours.stderr)
    assert lines == traceback_lines(theirs.stderr), (ours.stderr, theirs.stderr)
    assert lines[0] == "[rank0]: Traceback (most recent call last):" and "AttributeError" in lines[-1]
    assert not any(line.count("[rank") > 1 for line in ours.stderr.splitlines()), ours.stderr  # never [rank0]:[rank0]:
    assert ours.stderr.strip().splitlines()[-1] == (
        "ddpkit: error: worker rank 0 exited with code 1; the other workers were stopped (see its output above)"
    )
