"""benchmarks/gpt_mfu.py at a tiny size on the CPU: ddpkit and the hand-written loop of the GPT
workload, default and fast (bf16, fused AdamW; torch.compile left out: minutes on a CPU), each
row with its MFU, and ddpkit's own reported MFU equal to the benchmark's from the same figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--vocab-size", "128"]
PEAK = 0.1


@pytest.mark.slow
def test_the_gpt_benchmark_runs_tiny_on_a_cpu_and_reports_each_rows_mfu(tmp_path):
    out, runs = tmp_path / "gpt_mfu.md", tmp_path / "runs.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpt_mfu.py", "--device", "cpu", *TINY, "--batch-size", "2", "--steps", "3"]
        + ["--threads", "1", "--no-compile", "--peak-tflops", str(PEAK), "--out", str(out), "--json", str(runs)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in out.read_text().splitlines()}
    for name in ("hw-default", "ddpkit-default", "hw-fast", "ddpkit-fast"):
        assert table[name][5].endswith("%"), table[name]  # the MFU column
    assert "bf16, fused AdamW" in table["ddpkit-fast"][1] and "fp32, eager" in table["hw-default"][1]
    saved = json.loads(runs.read_text())
    flops = saved["flops_per_sample"]
    for run in saved["runs"]:
        if run["name"].startswith("ddpkit"):  # what ddpkit reported == the benchmark's own arithmetic
            assert run["reported_mfu"] == pytest.approx(run["steady_samples_per_s"] * flops / 1e12 / PEAK, rel=1e-3)
