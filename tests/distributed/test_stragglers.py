"""A rank that holds the others up is named, with where its time goes, in the progress lines
and in summary.json. (Whether a fast rank is also named depends on the machine's load: a
loaded CPU can make one fast rank's compute 1.2x another's, so only the slow rank is asserted.)"""

import json
from pathlib import Path

import pytest
from tests.conftest import run_ddpkit

pytestmark = pytest.mark.serial  # a rank slower by tens of ms a step is named, and no other: alone

TASK = str(Path(__file__).parent / "scripts" / "slow_data_task.py") + ":build"


def test_a_rank_slow_to_load_its_data_is_named_with_where_its_time_goes(tmp_path):
    run = tmp_path / "run"
    # rank 1 sleeps 10 ms per item: 40 ms a step of 4 samples, against ~1 ms of compute (quiet machine)
    out = run_ddpkit(
        "train", TASK, "--nproc", "3", "--batch-size", "4", "--epochs", "1", "--straggler-every", "5",
        "--progress", "lines", "--save-every", "0", "--run-dir", str(run),
    ).stdout  # fmt: skip
    summary = json.loads((run / "summary.json").read_text())
    named = {f["rank"]: f for f in summary["stragglers"]}
    assert 1 in named, summary["stragglers"]
    assert named[1]["where"] == "data" and named[1]["ratio"] == max(f["ratio"] for f in named.values()) > 1.2
    split = {s["rank"]: s for s in summary["step_time_split"]}
    assert split[1]["data_s"] > 5 * max(split[0]["data_s"], split[2]["data_s"])
    assert split[0]["wait_s"] > split[1]["wait_s"]  # the others wait for it in the gradient sync
    assert [s["steps"] for s in summary["step_time_split"]] == [14, 14, 14]  # ceil(160 / 12)
    assert "ddpkit: rank 1 is slow:" in out and "most in data" in out
    assert "slow rank    1:" in out
