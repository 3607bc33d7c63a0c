"""A strategy added in one file (toy_strategy.py) and registered is offered by --strategy,
refused by its own rule and the shared ones, built by the workers, and planned by `ddpkit plan`
with its own memory model; hsdp is FSDP's entry with a 2-D layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import toy_strategy

import ddpkit
from ddpkit import DdpkitError, RunConfig
from ddpkit.cli import main
from ddpkit.parallel.spec import (
    FSDP,
    HSDP,
    StrategyConfig,
    check,
    register,
    strategy_spec,
    strategy_specs,
    unregister,
)


@pytest.fixture
def toy():
    register(toy_strategy.TOY)
    yield toy_strategy.TOY
    unregister("toy")


def test_hsdp_is_fsdp_with_replicas_and_the_builtins_keep_their_order():
    assert [s.name for s in strategy_specs()] == ["ddp", "fsdp", "hsdp", "auto"]
    assert HSDP.shards and HSDP.build == FSDP.build and HSDP.memory is FSDP.memory and HSDP.rules == FSDP.rules
    assert HSDP.replicas and FSDP.replicas  # both take --replicate R; hsdp only changes its default
    assert FSDP.mesh(StrategyConfig(name="fsdp"), 8, nnodes=2) == (1, 8)
    assert FSDP.mesh(StrategyConfig(name="fsdp", replicate=2), 8, nnodes=2) == (2, 4)
    assert HSDP.mesh(StrategyConfig(name="hsdp"), 8, nnodes=2) == (2, 4)
    assert strategy_spec("ddp").mesh(StrategyConfig(), 8, nnodes=2) == (8, 1)
    with pytest.raises(ValueError, match="already registered"):
        register(FSDP)
    with pytest.raises(DdpkitError, match="--strategy must be one of ddp, fsdp, hsdp, auto, got 'toy'"):
        strategy_spec("toy")


def test_a_registered_strategy_is_offered_by_the_cli_and_the_config(toy, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--strategy ddp|fsdp|hsdp|auto|toy " in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["train", "--help-all"])
    assert "--strategy {ddp,fsdp,hsdp,auto,toy}" in capsys.readouterr().out
    assert RunConfig(strategy="toy").strategy_config().name == "toy"
    with pytest.raises(DdpkitError, match="--strategy must be one of ddp, fsdp, hsdp, auto, toy, got 'nope'"):
        check(StrategyConfig(name="nope"))


def test_a_strategy_registered_before_the_cli_is_built_has_its_help_line():
    here = Path(__file__).parent
    code = (
        f"import sys; sys.path.insert(0, {str(here)!r}); import toy_strategy; "
        "from ddpkit.parallel.spec import register; register(toy_strategy.TOY); "
        "assert 'ddpkit.config' not in sys.modules and 'torch' not in sys.modules; "
        "from ddpkit.cli import main; main(['train', '--help-all'])"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "toy: a DDP variant that plans its optimizer state" in " ".join(out.split())


def test_its_own_rule_and_the_shared_ones_refuse(toy, tmp_path, capsys):
    with pytest.raises(DdpkitError, match=toy_strategy.REFUSAL + " bf16"):
        check(StrategyConfig(name="toy", precision="bf16"), 2)
    with pytest.raises(DdpkitError, match=toy_strategy.REFUSAL + " bf16"):
        RunConfig(strategy="toy", precision="bf16")
    assert main(["train", "--strategy", "toy", "--precision", "bf16", "--run-dir", str(tmp_path / "r")]) == 2
    assert toy_strategy.REFUSAL in capsys.readouterr().err and not (tmp_path / "r").exists()
    with pytest.raises(DdpkitError, match="drop --async-save with --strategy toy"):  # it has no background saves
        check(StrategyConfig(name="toy", async_save=True))
    with pytest.raises(DdpkitError, match="--replicate 2 sets the replicas of --strategy fsdp"):
        check(StrategyConfig(name="toy", replicate=2))
    check(StrategyConfig(name="toy", bucket_mb=4.0), 1)  # it takes DDP's knobs, and one process


def test_the_workers_build_it(toy, tmp_path):
    run = tmp_path / "run"
    summary = ddpkit.train(task="wine", strategy="toy", nproc=1, max_steps=2, run_dir=str(run), quiet=True)
    assert summary["strategy"] == "toy"
    assert json.loads((run / "summary.json").read_text())["strategy"] == "toy"


def test_the_plan_asks_its_memory_model(toy, capsys):
    plan = ddpkit.memory_plan("wine", nproc=4, strategy="toy", device_memory="1GB")
    ddp = plan.ddp
    assert (plan.toy.params, plan.toy.grads, plan.toy.transient) == (ddp.params, ddp.grads, 0)
    assert ddp.optimizer > 0 and plan.toy.optimizer == ddp.optimizer // 4  # split over 4 replicas
    assert plan.meshes["toy"] == (4, 1) and plan.mesh is None
    assert main(["plan", "wine", "--strategy", "toy", "--nproc", "4", "--device-memory", "1GB"]) == 0
    out = capsys.readouterr().out
    assert "FSDP x4            TOY" in out and "DDP yes, FSDP yes, TOY yes" in out
    assert "--strategy toy   TOY needs " in out and "per rank: fits" in out
    assert "TOY" not in ddpkit.memory_plan("wine", nproc=4, strategy="auto", device_memory="1GB").format("w")
