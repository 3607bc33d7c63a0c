"""The time ledger (training/ledger.py): a real run whose task sleeps in one part shows the sleep
in that part (one process, in this one, on the CPU); the parts and "other" add up to the wall
time; a restart's recovery and the work it lost come from the failure's and checkpoint's times."""

import time

import pytest

import ddpkit
from ddpkit import RunConfig
from ddpkit.launchers.report import mark_restart
from ddpkit.reporting.summary import format_summary, time_block
from ddpkit.training.ledger import PARTS, Ledger, OptimizerTimer, failure_time
from ddpkit.util.envvars import ERROR_DIR_VAR, LAUNCH_TIME_VAR, RESTART_COUNT_VAR, RESTARTED_FILE, attempt_errors

SLEEP_S = 0.05  # per sleeping call
TASK = """
import time
import torch
from torch import nn
from ddpkit import Task

SLEEP_S = {sleep}


class Slow(torch.utils.data.Dataset):
    def __init__(self, n, sleeps):
        g = torch.Generator().manual_seed(0)
        self.x, self.y, self.sleeps = torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g), sleeps

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.sleeps:
            time.sleep(SLEEP_S)
        return self.x[i], self.y[i]


class SlowModel(nn.Linear):
    sleeps = False

    def forward(self, x):
        if self.sleeps and self.training:
            time.sleep(SLEEP_S)
        return super().forward(x)


class SlowSGD(torch.optim.SGD):
    def step(self, closure=None):
        time.sleep(SLEEP_S)
        return super().step(closure)


def build(config=None, part="{part}"):
    if part == "startup":
        time.sleep(4 * SLEEP_S)
    model = SlowModel(4, 2)
    model.sleeps = part == "compute"
    return Task(
        model=model,
        train_set=Slow(8, part == "data"),
        eval_set=Slow(4, part == "eval"),
        optimizer=(lambda p: SlowSGD(p, lr=0.1)) if part == "optimizer" else (lambda p: torch.optim.SGD(p, lr=0.1)),
    )
"""
SLEPT = {  # seconds each part must hold at least: 2 passes of 2 steps (8 samples, batch 4)
    "data": 2 * 8 * SLEEP_S,
    "compute": 4 * SLEEP_S,
    "optimizer": 4 * SLEEP_S,
    "eval": 2 * 4 * SLEEP_S,
    "startup": 4 * SLEEP_S,
}


@pytest.mark.parametrize("part", sorted(SLEPT))
def test_a_task_that_sleeps_in_one_part_shows_it_in_that_part(part, tmp_path, monkeypatch):
    spec = tmp_path / f"slow_{part}.py"
    spec.write_text(TASK.replace("{sleep}", repr(SLEEP_S)).replace("{part}", part))
    monkeypatch.setenv(LAUNCH_TIME_VAR, repr(time.time()))  # this run's launch (the process may have run others)
    cfg = RunConfig(task=f"{spec}:build", nproc=1, device="cpu", epochs=2, batch_size=4, quiet=True)
    summary = ddpkit.train(cfg, run_dir=str(tmp_path / "run"))
    t = summary["time"]
    assert t["seconds"][part] >= SLEPT[part]
    steps = {p: t["seconds"][p] for p in ("data", "compute", "grad_sync", "optimizer", "eval")}
    if part in steps:
        assert max(steps, key=steps.get) == part  # the sleep outweighs the tiny model's work
    assert sum(t["seconds"].values()) == pytest.approx(t["wall_s"], abs=1e-3)  # "other" is the rest
    assert set(t["seconds"]) == {*PARTS, "other"}
    assert "  time         wall" in format_summary(summary)


def test_the_block_adds_up_and_never_shows_other_below_zero():
    t = time_block({"startup": 2.0, "compute": 6.0}, wall=10.0)
    assert t["seconds"]["other"] == 2.0 and t["percent"] == {"startup": 20.0, "compute": 60.0, "other": 20.0}
    over = time_block({"startup": 6.0, "compute": 6.0}, wall=10.0)  # the ranks' mean beyond rank 0's wall
    assert over["seconds"]["other"] == 0.0 and sum(over["percent"].values()) == pytest.approx(100.0)


def test_a_restart_carries_the_parts_and_counts_its_recovery_and_the_lost_work():
    now = time.time()
    ledger = Ledger(launched=now - 100, restarted=True)
    ledger.load({"launched": now - 100, "at": now - 50, "seconds": {"startup": 5.0, "compute": 30.0}})
    ledger.failed_at = now - 20  # the launcher saw the failure 30 s after the checkpoint
    ledger.passes_start()
    s = ledger.seconds
    assert (s["startup"], s["compute"], s["lost_work"]) == (5.0, 30.0, pytest.approx(30.0))
    assert 20.0 <= s["restart"] < 30.0  # from the failure to this first pass


def test_a_checkpoint_of_an_earlier_launch_is_not_carried_and_a_first_attempt_carries_nothing():
    now = time.time()
    restarted = Ledger(launched=now - 10, restarted=True)
    restarted.load({"launched": now - 500, "at": now - 400, "seconds": {"compute": 90.0}})  # a --resume's
    restarted.passes_start()
    assert restarted.seconds["compute"] == 0.0 and restarted.seconds["restart"] >= 10.0  # all since the launch
    first = Ledger(launched=now - 10, restarted=False)
    first.load({"launched": now - 10, "at": now - 5, "seconds": {"compute": 90.0}})
    first.passes_start()
    assert first.seconds["compute"] == 0.0 and first.seconds["startup"] >= 10.0


def test_the_launcher_leaves_the_failures_time_for_the_restarted_attempt(tmp_path, monkeypatch):
    before = time.time()
    mark_restart(tmp_path, 1)
    assert (attempt_errors(tmp_path, 1) / RESTARTED_FILE).exists()
    monkeypatch.setenv(ERROR_DIR_VAR, str(tmp_path))
    monkeypatch.setenv(RESTART_COUNT_VAR, "1")
    assert before <= failure_time() <= time.time()
    monkeypatch.setenv(RESTART_COUNT_VAR, "0")
    assert failure_time() is None  # a first attempt failed nothing before it


def test_the_optimizer_is_timed_by_its_hooks_on_a_cpu():
    import torch

    class Sleepy(torch.optim.SGD):
        def step(self, closure=None):
            time.sleep(SLEEP_S)
            return super().step(closure)

    p = torch.nn.Parameter(torch.ones(2))
    opt = Sleepy([p], lr=0.1)
    timer = OptimizerTimer(opt, torch.device("cpu"))
    for _ in range(3):
        p.grad = torch.ones(2)
        opt.step()
    assert timer.total() >= 3 * SLEEP_S  # the subclass's step runs the hooks nested: the outer pair counts
    before = timer.total()
    timer.remove()
    opt.step()
    assert timer.total() == before  # no longer counted
