"""--compile under FSDP and HSDP and with activation checkpointing, through the real CLI on 2
CPU processes (gloo): a tiny GPT (examples/gpt.py, 2 blocks) trained 4 SGD steps ends at the
eager FSDP model within float32 rounding (rtol 1e-5, atol 1e-6, as FSDP against DDP in
test_fsdp.py; measured: 1.2e-7 at most). Where g++ is on PATH the inductor backend runs (C++
kernels: another rounding) under FSDP, with and without checkpointing; the HSDP run and DDP with
checkpointing (whose refusal of --compile is gone) hide every C++ compiler (CXX names none that
exists) and so run aot_eager, which the output and summary.json say, with the reason: the same
traced graphs, and a cold inductor compilation less (the first inductor run takes most of the
time: ~30-60 s on 2 busy cores; the second reuses its kernels)."""

import json
import shutil

import pytest

from conftest import REPO, assert_state_close, load_model, max_abs_diff, run_ddpkit

TASK = str(REPO / "tests" / "distributed" / "scripts" / "compile_gpt.py") + ":build"
ARGS = ["--nproc", "2", "--device", "cpu", "--max-steps", "4", "--batch-size", "8", "--save-every", "0", "--seed", "0"]
INDUCTOR = "inductor" if shutil.which("g++") else "aot_eager"  # what ddpkit chooses here (compiling.py)

pytestmark = pytest.mark.slow  # inductor compiles each block on 2 cores: ~15-30 s a run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (run dir, output)}: eager FSDP, and --compile under FSDP, FSDP + activation
    checkpointing, and without a C++ compiler, DDP + activation checkpointing and HSDP (2 replicas
    x 1 shard). One inductor cache for the module: the second run reuses the first one's kernels."""
    root = tmp_path_factory.mktemp("compile")
    env = {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor-cache")}
    variants = {
        "eager": ["--strategy", "fsdp"],
        "fsdp": ["--strategy", "fsdp", "--compile"],
        "fsdp-ac": ["--strategy", "fsdp", "--compile", "--activation-checkpointing"],
        "ddp-ac": ["--strategy", "ddp", "--compile", "--activation-checkpointing"],
        "hsdp": ["--strategy", "hsdp", "--replicate", "2", "--compile"],
    }
    out = {}
    for name, flags in variants.items():
        extra = {"CXX": str(root / "no-such-compiler")} if name in ("hsdp", "ddp-ac") else {}
        proc = run_ddpkit("train", TASK, *ARGS, *flags, "--run-dir", str(root / name), env={**env, **extra})
        out[name] = (root / name, proc.stdout)
    return out


def _summary(run):
    return json.loads((run / "summary.json").read_text())


@pytest.mark.parametrize("name", ["fsdp", "fsdp-ac", "ddp-ac", "hsdp"])
def test_compiled_runs_end_at_the_eager_fsdp_model_within_rounding(runs, name):
    eager, _ = runs["eager"]
    run, _ = runs[name]
    assert_state_close(load_model(run), load_model(eager), rtol=1e-5, atol=1e-6)
    s = _summary(run)
    assert s["steps_done"] == 4 and s["compile"]["what"] == "blocks" and s["compile"]["blocks"] == 2
    assert _summary(eager)["compile"] is None


def test_the_runs_trained_and_compiled_per_block_with_the_backend_named(runs):
    eager, _ = runs["eager"]
    initial = _summary(eager)
    assert initial["eval_loss"] < 4.0  # trained: a uniform guess over the ~100 characters is 4.6
    for name in ("fsdp", "fsdp-ac"):
        run, output = runs[name]
        record = _summary(run)["compile"]
        assert record["backend"] == INDUCTOR, record
        assert f"ddpkit: --compile with the {INDUCTOR} backend: " in output
    s = _summary(runs["fsdp-ac"][0])
    assert s["strategy"] == "fsdp" and s["world_size"] == 2


@pytest.mark.parametrize("name, strategy", [("hsdp", "hsdp"), ("ddp-ac", "ddp")])
def test_without_a_cpp_compiler_it_compiles_with_aot_eager_and_says_why(runs, name, strategy):
    run, output = runs[name]
    s = _summary(run)
    assert s["strategy"] == strategy and s["compile"]["backend"] == "aot_eager"
    assert "no C++ compiler" in s["compile"]["why"] and "no-such-compiler" in s["compile"]["why"]
    assert "ddpkit: --compile with the aot_eager backend: no C++ compiler (" in output
    assert max_abs_diff(load_model(run), load_model(runs["eager"][0])) < 1e-5
