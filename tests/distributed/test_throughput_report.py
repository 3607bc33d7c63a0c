"""Throughput through the real CLI on CPU: with --peak-tflops a run reports tokens/s, TFLOP/s
per device and MFU in summary.json, every metrics.jsonl record, its epoch lines and its
summary, each consistent with its samples/s (TFLOP/s = FLOPs a sample x samples/s / devices /
1e12; MFU = TFLOP/s / the peak); without it, a CPU run has no MFU."""

import json

import pytest

from conftest import REPO, run_ddpkit

GPT = str(REPO / "examples" / "gpt.py") + ":build"
TINY = [f"--task-arg={kv}" for kv in ("n_layer=2", "n_head=2", "n_embd=32", "block_size=32", "max_samples=32")]
PEAK = 0.05  # TFLOP/s: a made-up peak, so that the MFU of a tiny CPU run is a readable number


def consistent(rec: dict, flops: float, tokens: int, devices: int) -> None:
    tflops = flops * rec["samples_per_s"] / devices / 1e12
    assert rec["tflops_per_device"] == pytest.approx(tflops, rel=1e-4)
    assert rec["mfu"] == pytest.approx(tflops / PEAK, rel=1e-4)
    assert rec["tokens_per_s"] == pytest.approx(rec["samples_per_s"] * tokens, rel=1e-4)


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    """FSDP over 2 processes of a GPT built on the meta device: the FLOPs are counted before any
    rank has a real weight, and the rate per device is half the job's."""
    run = tmp_path_factory.mktemp("mfu") / "run"
    proc = run_ddpkit(
        *("train", GPT, "--nproc", "2", "--strategy", "fsdp", "--task-arg", "init=meta", *TINY),
        *("--epochs", "2", "--batch-size", "4", "--threads", "1", "--save-every", "0", "--progress", "lines"),
        *("--peak-tflops", str(PEAK), "--run-dir", str(run)),
    )
    return run, proc.stdout


def test_a_run_with_a_peak_reports_a_consistent_mfu_in_summary_json_and_every_record(gpt_run):
    run, _ = gpt_run
    t = json.loads((run / "summary.json").read_text())["throughput"]
    assert t["tokens_per_sample"] == 32 and t["devices"] == 2 and t["flops_per_sample"] > 0
    assert (t["peak_tflops"], t["peak_source"]) == (PEAK, "--peak-tflops")
    consistent(t, t["flops_per_sample"], 32, 2)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for rec in records:
        consistent(rec, t["flops_per_sample"], 32, 2)


def test_its_epoch_lines_and_summary_show_the_rates(gpt_run):
    _, out = gpt_run
    epochs = [line for line in out.splitlines() if line.startswith("epoch ")]
    assert len(epochs) == 2 and all("tokens/s " in line and "TFLOP/s " in line and "mfu " in line for line in epochs)
    compute = next(line for line in out.splitlines() if line.startswith("  compute "))
    assert "per device" in compute and f"of {PEAK:g} TFLOP/s (--peak-tflops)" in compute
    assert "tokens/s (training" in out


def test_a_cpu_run_without_a_peak_has_no_mfu(reference_run):
    run = reference_run("--nproc", "2", "--seed", "5", "--save-every", "2", "--epochs", "6", "--quiet")  # Wine
    t = json.loads((run / "summary.json").read_text())["throughput"]
    assert t["mfu"] is None and t["peak_tflops"] is None and "--peak-tflops" in t["peak_source"]
    assert t["flops_per_sample"] == 4480 and t["tokens_per_s"] is None  # features, not tokens
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        assert "mfu" not in rec and "tokens_per_s" not in rec
        assert rec["tflops_per_device"] == pytest.approx(4480 * rec["samples_per_s"] / 2 / 1e12, rel=1e-4)
