"""A node whose link is slow (its interface throttled with tbf) is named, with its ranks, by the
straggler report's link probe: in rank 0's progress lines, the summary and summary.json. Every
rank waits for that link in the gradient sync, so the step-time split alone cannot name it (it
would name the fast node's rank, which waits for the slow one's data inside its steps)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.cluster

TASK = str(Path(__file__).parent / "scripts" / "wide_mlp.py") + ":build"
RATE_MB_S = 30e6 / 8 / 1e6  # 30 mbit/s
GRAD_MB = (64 * 2048 + 2048 + 2048 * 2 + 2) * 4 / 1e6  # what node 2 sends a step in a 2-rank ring


def _tc(node, *args):
    subprocess.run(["nsenter", f"--net={node.netns_path}", "tc", "qdisc", *args], check=True, timeout=20)


def test_the_node_with_a_slow_link_is_named_with_its_ranks(two_nodes, tmp_path):
    n1, n2 = two_nodes.nodes[0], two_nodes.nodes[1]
    run_dir, port = tmp_path / "run", str(two_nodes.next_port())
    base = [
        sys.executable, "-m", "ddpkit", "train", TASK, "--nproc", "1", "--nnodes", "2", "--master-addr", n1.ip,
        "--master-port", port, "--batch-size", "8", "--epochs", "1", "--straggler-every", "5", "--threads", "1",
        "--progress", "lines", "--save-every", "0", "--timeout", "60", "--run-dir", str(run_dir),
    ]  # fmt: skip
    _tc(n2, "add", "dev", n2.ifname, "root", "tbf", "rate", "30mbit", "burst", "32kbit", "latency", "400ms")
    try:
        results = two_nodes.run_all(
            [(n1, base + ["--node-rank", "0"]), (n2, base + ["--node-rank", "1"])],
            timeout=150,
            env={"PYTHONPATH": str(REPO / "src")},
            worker_env=False,
        )
    finally:
        _tc(n2, "del", "dev", n2.ifname, "root")
    logs = "\n\n".join(f"--- {r.node.name} rc={r.returncode}\n{r.output}" for r in results)
    assert all(r.returncode == 0 for r in results), logs
    out = results[0].output
    summary = json.loads((run_dir / "summary.json").read_text())
    # only the slow node's rank is named, for its link (rank 0, which waits for that link inside its
    # steps' gradient sync, looks busier in compute, and is not named for it)
    links = summary["stragglers"]
    assert [(f["rank"], f["where"], f["node"], f["ranks"]) for f in links] == [(1, "link", 1, [1])], links
    # tbf lets no more than its rate through; the other node's probe ran faster than that
    assert links[0]["link_mb_per_s"] < 1.1 * RATE_MB_S < links[0]["others_mb_per_s"], links
    assert "ddpkit: node 1 (ranks 1) has a slow link:" in out, logs
    assert "slow link    node 1 (ranks 1):" in out, logs
    split = summary["step_time_split"]
    assert [s["steps"] for s in split] == [20, 20]  # 320 samples / (2 x 8)
    # both ranks spend the throttled gradient sync inside their steps: at least half of what
    # node 2 had to send over its 3.75 MB/s (the rest may sit in socket buffers between steps)
    for s in split:
        assert s["compute_s"] + s["wait_s"] > 0.5 * 20 * GRAD_MB / RATE_MB_S, split
