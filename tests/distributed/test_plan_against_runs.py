"""The memory plan against real runs (gloo on CPU): `ddpkit plan --json` in its own process, as a
user runs it, then the run it plans. The plan counts the whole process (fixed cost, state, in
flight, activations, rank 0's end of run); --strategy auto picks what fits with everything
counted, and trains exactly what the named settings train; the summary says what its peak is
made of. The benchmark (benchmarks/memory.py) holds the figures at three sizes; here one
small size within a looser bound than its 0.9-1.1."""

import json

import pytest

from conftest import REPO, assert_state_equal, load_model, run_ddpkit

DEEP = str(REPO / "examples" / "deep_mlp.py") + ":build"
# 19.7M parameters: DDP holds ~300 MiB of AdamW state per rank, FSDP on 2 ranks at its peak ~120
DEEP_ARGS = ["--nproc", "2", "--task-arg", "width=640", "--batch-size", "24"]
GPT = str(REPO / "examples" / "gpt.py") + ":build"
GPT_S = [f"--task-arg={k}={v}" for k, v in {"n_layer": 4, "n_embd": 128, "n_head": 4, "block_size": 128}.items()]
GPT_ARGS = ["--nproc", "2", "--batch-size", "8", *GPT_S, "--task-arg", "max_samples=128"]
MiB = 2**20


def _plan(*args: str, cwd) -> dict:
    return json.loads(run_ddpkit("plan", *args, "--json", cwd=cwd, timeout=120).stdout)


def _summary(run) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_auto_counts_everything_picks_what_fits_and_trains_what_the_named_settings_train(tmp_path):
    plan = _plan(DEEP, *DEEP_ARGS, cwd=tmp_path)
    ddp, fsdp = plan["strategies"]["ddp"], plan["strategies"]["fsdp"]
    assert ddp["fixed"] > 100 * MiB  # torch, the modules, the data: measured, in the total
    assert ddp["peak"] == max(ddp["fixed"] + ddp["state"] + ddp["in_flight"] + ddp["activations"], ddp["end_of_run"])
    assert fsdp["grads_made_in_backward"] > 0 and ddp["grads_made_in_backward"] == 0  # DDP's stay in its state
    assert ddp["peak"] - fsdp["peak"] > 100 * MiB
    budget = int((ddp["peak"] + fsdp["peak"]) / 2 / plan["fit_fraction"])  # only FSDP's peak fits
    common = [*DEEP_ARGS, "--seed", "3", "--max-steps", "4", "--save-every", "0", "--device-memory", str(budget)]
    auto = run_ddpkit("train", DEEP, *common, "--strategy", "auto", "--run-dir", str(tmp_path / "auto"), cwd=tmp_path)
    assert "ddpkit: --strategy auto: fsdp: DDP needs" in auto.stdout and "FSDP x2 needs" in auto.stdout
    s = _summary(tmp_path / "auto")
    assert s["strategy"] == "fsdp" and not s["activation_checkpointing"]
    assert max(s["peak_memory_bytes"]) <= budget  # it did fit
    named = run_ddpkit("train", DEEP, *common, "--strategy", "fsdp", "--run-dir", str(tmp_path / "fsdp"), cwd=tmp_path)
    assert "--strategy auto" not in named.stdout
    # the probe that chose left the model and the random streams as they were
    assert_state_equal(load_model(tmp_path / "auto"), load_model(tmp_path / "fsdp"))


@pytest.mark.parametrize("settings", [["--strategy", "ddp"], ["--strategy", "fsdp", "--activation-checkpointing"]])
def test_the_plan_is_within_a_loose_bound_of_the_measured_peak_and_the_summary_breaks_it_down(tmp_path, settings):
    plan = _plan(GPT, *GPT_ARGS, *settings, cwd=tmp_path)
    planned = plan["strategies"][settings[1]]["peak"]
    run = tmp_path / "run"
    out = run_ddpkit("train", GPT, *GPT_ARGS, *settings, "--max-steps", "4", "--run-dir", str(run), cwd=tmp_path)
    s = _summary(run)
    measured = max(s["peak_memory_bytes"])
    assert 0.8 <= measured / planned <= 1.25, (measured / MiB, planned / MiB)
    fixed = s["fixed_bytes_per_rank"]
    assert 100 * MiB < fixed < measured
    line = next(x for x in out.stdout.splitlines() if x.strip().startswith("made of"))
    assert "fixed" in line and "state" in line and "activations" in line and "the rest" in line


def test_a_micro_batch_auto_cuts_keeps_the_global_batch(tmp_path):
    """With room for DDP's state but not for the activations of the asked micro-batch, auto
    shards, recomputes (the GPT's blocks) or cuts the micro-batch; whichever, the global batch
    stays, and a run with the chosen settings named trains the same model."""
    plan = _plan(GPT, *GPT_ARGS[:2], *GPT_S, "--batch-size", "32", "--task-arg", "max_samples=256", cwd=tmp_path)
    ddp = plan["strategies"]["ddp"]
    # room for the state and a quarter of the activations: a whole micro-batch cannot fit
    budget = int((ddp["fixed"] + ddp["state"] + ddp["in_flight"] + ddp["activations"] / 4) / plan["fit_fraction"])
    common = [*GPT_ARGS[:2], *GPT_S, "--task-arg", "max_samples=256", "--max-steps", "3", "--save-every", "0"]
    auto_dir = tmp_path / "auto"
    run_ddpkit(
        "train", GPT, *common, "--batch-size", "32", "--strategy", "auto", "--device-memory", str(budget),
        "--run-dir", str(auto_dir), cwd=tmp_path,
    )  # fmt: skip
    s = _summary(auto_dir)
    assert s["global_batch"] == 64  # 2 x 32, whatever micro-batch was chosen
    chosen = ["--batch-size", str(s["batch_size"]), "--accumulate", str(s["accumulate"])]
    assert (s["batch_size"], s["activation_checkpointing"]) != (32, False), s
    named = [*chosen, "--strategy", s["strategy"]] + ["--activation-checkpointing"] * s["activation_checkpointing"]
    run_ddpkit("train", GPT, *common, *named, "--run-dir", str(tmp_path / "named"), cwd=tmp_path)
    assert_state_equal(load_model(auto_dir), load_model(tmp_path / "named"))
