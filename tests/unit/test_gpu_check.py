"""scripts/gpu_check.sh (the one-shot check of the GPU path): valid bash; without a GPU and
without --cpu it refuses at once, saying why and what to do, and starts nothing. The script
itself (`bash scripts/gpu_check.sh --cpu`, a few minutes) is run by hand, not here."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def test_gpu_check_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


def _run(tmp_path, *args):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "TMPDIR": str(tmp_path)}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )


def test_gpu_check_refuses_without_a_gpu_and_names_the_dry_run(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here: the script would run its checks")
    proc = _run(tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA GPU is visible" in proc.stdout and f"torch {torch.__version__}" in proc.stdout
    assert "pass --cpu" in proc.stdout
    assert (
        "no CUDA GPU is visible" in (tmp_path / "out" / "gpu_check.log").read_text()
    )  # what comes back from a GPU machine
    assert not list(tmp_path.glob("ddpkit-gpu-check.*"))  # no work folder: nothing was started


def test_gpu_check_refuses_an_unknown_argument(tmp_path):
    proc = _run(tmp_path, "--gpus", "2")
    assert proc.returncode == 2 and "unknown argument '--gpus'" in proc.stderr


def test_gpu_check_runs_the_steps_under_sync_debug_mode_and_the_check_trains_on_a_cpu():
    text = SCRIPT.read_text()
    assert "step 10 syncdebug step_syncdebug" in text and "10" in _default_steps(text)  # registered and run by default
    assert "scripts/sync_check.py --device" in text
    check = SCRIPT.parent / "sync_check.py"
    assert 'set_sync_debug_mode("error")' in check.read_text()
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1] / "src")}
    proc = subprocess.run(
        [sys.executable, str(check), "--device", "cpu", "--steps", "2", "--warmup", "1"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("sync_check: 2 steps (--accumulate 2) on cpu") and "mean loss" in proc.stdout
    assert 'scripts/sync_check.py --device "$DEV" --steps 20 --accumulate 2 --data-on-device' in text
    proc = subprocess.run(
        [sys.executable, str(check), "--device", "cpu", "--steps", "9", "--warmup", "1", "--data-on-device"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip  (10 steps: a second pass of the data set kept on the device)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("sync_check: 9 steps (--accumulate 2, data on the device) on cpu")


def _default_steps(text):
    """The steps the script runs without --steps (its ONLY=... line)."""
    return text.split('ONLY="', 1)[1].split('"', 1)[0].split(",")


def _function(text, name):
    start = text.index(f"{name}() {{")
    return text[start : text.index("\n}\n", start)]


def test_the_cnn_resume_runs_deterministic_and_the_fused_step_checks_the_default():
    text = SCRIPT.read_text()
    cnn = _function(text, "step_resume_cnn")
    assert "--deterministic)" in cnn.splitlines()[1]  # every run of the step: full, half, resumed, control
    assert 'pycheck summary "$W/cnn-split" deterministic=true' in cnn
    fused = _function(text, "step_fused")
    assert "fused_optimizer=$fused" in fused and "--fused-optimizer off" in fused


def test_the_shared_gpu_step_runs_its_cpu_stand_in(tmp_path):
    """Step 11 (DDPKIT_SHARE_GPU=1: 2 ranks on one GPU over gloo) with --cpu: the same DDP, FSDP,
    sharded-checkpoint and world-1 resume runs on CPU ranks (~12 s), every check passing."""
    text = SCRIPT.read_text()
    step = _function(text, "step_sharegpu")
    assert "step 11 sharegpu step_sharegpu" in text and "11" in _default_steps(text)  # registered and run by default
    assert step.count("DDPKIT_SHARE_GPU=1 trained") == 2 and '"cuda" in r' in step  # the CUDA RNG state, on a GPU
    proc = _run(tmp_path, "--cpu", "--steps", "11")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = (tmp_path / "out" / "gpu_check_table.txt").read_text()
    assert "11   sharegpu    PASS" in table and "NCCL, P2P and multi-GPU bandwidth not exercised" in table
    assert "resumed at world 1 from the 2-rank sharded checkpoint" in proc.stdout


def test_the_sync_step_allows_no_host_sync_and_the_whole_check_fits_8_minutes_on_a_gpu():
    text = SCRIPT.read_text()
    sync = _function(text, "step_syncdebug")
    assert '"fused AdamW: the device decides, 0 host syncs a step"' in sync  # scripts/sync_check.py's line on a GPU
    assert "fused AdamW: the device decides, 0 host syncs a step" in (SCRIPT.parent / "sync_check.py").read_text()
    gpu = text[text.index("if [[ $MODE == gpu ]]; then\n  DEV=cuda") :]
    hard = int(gpu[gpu.index("GPU_CHECK_HARD_S:-") :].split("-", 1)[1].split("}", 1)[0])
    assert hard <= 8 * 60  # every command ends by then (limit), the table follows at once
    gpt = _function(text, "step_gpt")
    assert "HARD_S - (SECONDS - START)" in gpt and "--no-compile" in gpt  # sized to the time left
    assert text.rstrip().splitlines()[-1] != "step 8b gpt step_gpt"  # the table follows it
    assert text.index("step 8b gpt step_gpt") > text.index("step 10 syncdebug step_syncdebug")  # run last


@pytest.mark.slow
def test_gpu_check_on_a_cpu_reports_the_gpt_rows_and_an_mfu_column_in_at_most_8_files(tmp_path):
    proc = _run(tmp_path, "--cpu", "--steps", "10,8b")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    out = tmp_path / "out"
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 0 < len(files) <= 8, files
    lines = (out / "gpu_check_table.txt").read_text().splitlines()  # a title, a blank line, the header, rows
    header = lines[2].split()
    rows = {line.split()[0]: line.split() for line in lines[3:]}
    assert header == ["step", "name", "status", "secs", "mfu", "note"]
    assert rows["10"][2] == "PASS" and rows["10"][4] == "-"  # no training run: no MFU
    assert rows["8b"][2] == "PASS" and rows["8b"][4].endswith("%"), rows["8b"]
    assert "ddpkit-fast" in (out / "gpu.md").read_text() and "| MFU |" in (out / "gpu.md").read_text()
    assert "ddpkit-fast" in (out / "gpu_check.log").read_text()  # the benchmark's own logs, merged
