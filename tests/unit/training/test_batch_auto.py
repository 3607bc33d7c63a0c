"""--batch-size auto's parts that need no worker: the search, its bounds, the refusals, the
micro-batch a resume keeps and the process's memory limit as the CPU's budget."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddpkit.config import RunConfig
from ddpkit.errors import DdpkitError
from ddpkit.planning.process import detect_device_memory
from ddpkit.task import as_task
from ddpkit.training.batch_auto import MAX_BATCH, kept_from_resume, largest_fitting, search_cap


def test_the_search_finds_the_largest_batch_within_the_budget() -> None:
    asked = []

    def peak(b: int) -> int:
        asked.append(b)
        return 1000 + 37 * b

    assert largest_fitting(peak, 1000 + 37 * 123, 4096) == 123
    assert len(asked) <= 14  # a bisection, not a scan of 4096
    assert largest_fitting(peak, 1000 + 37 * 123 + 36, 4096) == 123  # one byte short of 124
    assert largest_fitting(peak, 10**9, 50) == 50  # the cap bounds it
    assert largest_fitting(peak, 1000, 50) is None  # not even one sample


def test_the_cap_is_each_processes_share_of_the_data_or_of_the_global_batch() -> None:
    task = as_task((torch.utils.data.TensorDataset(torch.zeros(100, 2)), torch.nn.Linear(2, 1), torch.optim.SGD))
    assert search_cap(RunConfig(batch_size="auto"), task, 4) == 25
    assert search_cap(RunConfig(batch_size="auto", global_batch_size=40), task, 4) == 10
    assert search_cap(RunConfig(batch_size="auto"), task, 1000) == 1
    assert MAX_BATCH >= 4096
    # before the workers choose, the launcher's checks of --global-batch-size still run
    assert RunConfig(batch_size="auto", global_batch_size=64).batch_plan(2).global_batch == 64
    with pytest.raises(DdpkitError, match="smaller than the 4 processes"):
        RunConfig(batch_size="auto", global_batch_size=3).batch_plan(4)


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"strategy": "auto"}, "--batch-size auto with --strategy auto: auto fits the micro-batch you give it"),
        ({"batch_size": "big"}, "--batch-size must be a positive integer or auto, got 'big'"),
    ],
)
def test_batch_auto_is_refused_in_one_line_where_no_plan_sizes_it(settings: dict, said: str) -> None:
    from ddpkit.config.values import parse_batch_size

    with pytest.raises(DdpkitError, match="^" + said.replace("(", r"\(")):
        if "strategy" in settings:
            RunConfig(batch_size="auto", **settings)
        else:
            parse_batch_size(settings["batch_size"])
    assert RunConfig(batch_size="auto", strategy="fsdp").batch_size == "auto"


def test_a_resume_keeps_the_batch_its_config_recorded(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"batch_size": 801}))
    assert kept_from_resume(RunConfig(batch_size="auto", resume=True, run_dir=str(tmp_path)), tmp_path) == 801
    assert kept_from_resume(RunConfig(batch_size="auto", run_dir=str(tmp_path)), tmp_path) is None  # a fresh start


LIMITED = """
import resource
resource.setrlimit(resource.RLIMIT_DATA, (700 * 2**20, resource.getrlimit(resource.RLIMIT_DATA)[1]))
from ddpkit.planning.process import detect_device_memory
print(detect_device_memory("cpu", 1)[0])
"""


def test_a_cpus_budget_is_at_most_the_processes_memory_limit() -> None:
    soft = resource.getrlimit(resource.RLIMIT_DATA)[0]
    if soft != resource.RLIM_INFINITY and soft < 700 * 2**20:
        pytest.skip("this process is already limited below the test's limit")
    out = subprocess.run([sys.executable, "-c", LIMITED], capture_output=True, text=True, check=True).stdout
    assert int(out) == 700 * 2**20
    assert detect_device_memory("cpu", 1)[0] != 700 * 2**20
