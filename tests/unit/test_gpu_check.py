"""scripts/gpu_check.py (the one-shot check of the GPU path) and its thin entry point
scripts/gpu_check.sh: without a GPU and without --cpu it refuses at once, saying why and what to
do, and starts nothing; with --cpu its steps run their CPU stand-ins, every check passing, and
gpu_check.json records every step. The whole check (`bash scripts/gpu_check.sh --cpu`, a few
minutes) is run by hand, not here."""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
SCRIPT = SCRIPTS / "gpu_check.py"
ENTRY = SCRIPTS / "gpu_check.sh"


@pytest.fixture(scope="module")
def gpu_check():
    """The program as a module (scripts/ on the path, as when it runs), for what it would run."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        import gpu_check
        import gpu_check_measure
        import gpu_check_steps

        yield gpu_check, gpu_check_steps, gpu_check_measure
    finally:
        sys.path.remove(str(SCRIPTS))


def test_the_entry_point_is_thin_valid_bash_and_every_script_under_150_lines_of_bash():
    subprocess.run(["bash", "-n", str(ENTRY)], check=True, timeout=30)
    assert "scripts/gpu_check.py" in ENTRY.read_text()
    for sh in SCRIPTS.glob("*.sh"):
        assert len(sh.read_text().splitlines()) <= 150, sh


def _run(tmp_path, *args, entry=False):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "TMPDIR": str(tmp_path)}
    argv = ["bash", str(ENTRY)] if entry else [sys.executable, str(SCRIPT)]
    return subprocess.run([*argv, *args], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_gpu_check_refuses_without_a_gpu_and_names_the_dry_run(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here: the script would run its checks")
    proc = _run(tmp_path, entry=True)  # through the bash entry point, with $PYTHON
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA GPU is visible" in proc.stdout and f"torch {torch.__version__}" in proc.stdout
    assert f"visible to {sys.executable} " in proc.stdout  # the interpreter $PYTHON named
    assert "pass --cpu" in proc.stdout
    assert (
        "no CUDA GPU is visible" in (tmp_path / "out" / "gpu_check.log").read_text()
    )  # what comes back from a GPU machine
    assert not list(tmp_path.glob("ddpkit-gpu-check.*"))  # no work folder: nothing was started


def test_gpu_check_refuses_an_unknown_argument(tmp_path):
    proc = _run(tmp_path, "--gpus", "2")
    assert proc.returncode == 2 and "unknown argument '--gpus'" in proc.stderr


def test_gpu_check_runs_the_steps_under_sync_debug_mode_and_the_check_trains_on_a_cpu(gpu_check):
    program, _, measure = gpu_check
    assert ("10", "syncdebug", measure.step_syncdebug) in program.STEPS and "10" in program.DEFAULT_STEPS.split(",")
    text = inspect.getsource(measure.step_syncdebug)
    assert '"scripts/sync_check.py", "--device", c.mode.dev, "--steps", "20", "--accumulate", "2"' in text
    assert '[*argv, "--data-on-device"]' in text
    check = SCRIPTS / "sync_check.py"
    assert 'set_sync_debug_mode("error")' in check.read_text()
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS.parent / "src")}
    proc = subprocess.run(
        [sys.executable, str(check), "--device", "cpu", "--steps", "2", "--warmup", "1"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("sync_check: 2 steps (--accumulate 2) on cpu") and "mean loss" in proc.stdout
    proc = subprocess.run(
        [sys.executable, str(check), "--device", "cpu", "--steps", "9", "--warmup", "1", "--data-on-device"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip  (10 steps: a second pass of the data set kept on the device)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("sync_check: 9 steps (--accumulate 2, data on the device) on cpu")


def test_the_cnn_resume_runs_deterministic_and_the_fused_step_checks_the_default(gpu_check):
    _, steps, _ = gpu_check
    cnn = inspect.getsource(steps.step_resume_cnn)
    assert '"--deterministic"]' in cnn and "*common" in cnn  # every run of the step: full, half, resumed, control
    assert 'c.runs_check("--deterministic recorded in the summary", "summary", split, "deterministic=true")' in cnn
    fused = inspect.getsource(steps.step_fused)
    assert 'f"fused_optimizer={fused}"' in fused and '"--fused-optimizer", "off"' in fused


def test_the_shared_gpu_step_runs_its_cpu_stand_in_and_the_record_holds_every_check(tmp_path, gpu_check):
    """Step 11 (DDPKIT_SHARE_GPU=1: 2 ranks on one GPU over gloo) with --cpu: the same DDP, FSDP,
    sharded-checkpoint and world-1 resume runs on CPU ranks (~12 s), every check passing."""
    program, steps, _ = gpu_check
    step = inspect.getsource(steps.step_sharegpu)
    assert ("11", "sharegpu", steps.step_sharegpu) in program.STEPS and "11" in program.DEFAULT_STEPS.split(",")
    assert step.count("env=share") == 2 and '{"DDPKIT_SHARE_GPU": "1"}' in step
    assert '"cuda" in r' in inspect.getsource(steps.runs.cmd_shards)  # the CUDA RNG state, on a GPU
    proc = _run(tmp_path, "--cpu", "--steps", "11")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = (tmp_path / "out" / "gpu_check_table.txt").read_text()
    assert "11   sharegpu    PASS" in table and "NCCL, P2P and multi-GPU bandwidth not exercised" in table
    assert "resumed at world 1 from the 2-rank sharded checkpoint" in proc.stdout
    record = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert record["exit"] == 0 and record["mode"] == "cpu" and [s["id"] for s in record["steps"]] == ["11"]
    (share,) = record["steps"]
    assert share["status"] == "PASS" and len(share["checks"]) >= 8 and all(ch["ok"] for ch in share["checks"])
    assert [cmd["exit"] for cmd in share["commands"]] == [0, 0, 0, 0]  # 1 rank, DDP, FSDP, the resume
    assert not list(tmp_path.glob("ddpkit-gpu-check.*"))  # every step passed: the work folder is gone


def test_a_failed_check_fails_its_step_and_the_exit_and_keeps_the_work_folder(tmp_path):
    # --steps 7 with no time for any command: the step fails, the table says FAIL, the exit is 1
    # and the work folder stays for a look
    env_extra = {"GPU_CHECK_CMD_TIMEOUT": "1"}  # under 5 s: no ddpkit command has time to run
    env = {**os.environ, "OUT": str(tmp_path / "out"), "TMPDIR": str(tmp_path), **env_extra}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--steps", "7"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "7    resume      FAIL" in (tmp_path / "out" / "gpu_check_table.txt").read_text()
    assert "wine-half: stopped after its time limit (1 s)" in proc.stdout
    record = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert record["exit"] == 1 and record["steps"][0]["status"] == "FAIL"
    assert all(cmd["exit"] == 124 for cmd in record["steps"][0]["commands"])
    assert "no time left" in proc.stdout and list(tmp_path.glob("ddpkit-gpu-check.*"))


def test_the_sync_step_allows_no_host_sync_and_the_whole_check_fits_8_minutes_on_a_gpu(gpu_check, monkeypatch):
    program, _, measure = gpu_check
    sync = inspect.getsource(measure.step_syncdebug)
    assert '"fused AdamW: the device decides .*, 0 host syncs a step"' in sync  # sync_check.py's line on a GPU
    line = (SCRIPTS / "sync_check.py").read_text()  # what it prints: "fused AdamW: the device decides by ..., 0 ..."
    assert '("fused " if is_fused(opt) else "plain ") + "AdamW"' in line
    assert 'how = f"{kind}: the device decides {paths[runner._how]}, 0 host syncs a step"' in line
    for name in ("GPU_CHECK_HARD_S", "GPU_CHECK_BUDGET_S"):
        monkeypatch.delenv(name, raising=False)
    gpu = program.Mode.of("gpu", 1)
    assert gpu.hard_s <= 8 * 60 and gpu.budget_s < gpu.hard_s  # every command ends by then, the table follows
    gpt = inspect.getsource(measure.step_gpt)
    assert "m.hard_s - c.elapsed() - 15" in gpt and "--no-compile" in inspect.getsource(measure.gpt_variants)
    assert [s[0] for s in program.STEPS][-1] == "8b"  # run last, after step 10; the table follows it


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


def test_the_tp_step_is_opt_in_and_runs_a_2x2_mesh_on_shared_ranks(gpu_check):
    """Step 12 (a 2x2 FSDP x TP mesh on 4 ranks sharing the device, benchmarks/tp_fsdp.py) runs only
    when --steps names it: the default check stays within its 8 minutes."""
    program, _, measure = gpu_check
    assert ("12", "tp", measure.step_tp) in program.STEPS and "12" not in program.DEFAULT_STEPS.split(",")
    step = inspect.getsource(measure.step_tp)
    assert '"--nproc", "4", "--tp", "2", "--strategy", "fsdp"' in step and '{"DDPKIT_SHARE_GPU": "1"}' in step
    assert '"benchmarks/tp_fsdp.py", "--device", c.mode.dev' in step
