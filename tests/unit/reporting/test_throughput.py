"""The device's peak from the table (by the name torch gives the GPU, at the run's precision),
the rates beside samples/s, and where they show: the summary's lines and the epoch lines."""

import pytest
import torch

from ddpkit.reporting.progress import rates_text
from ddpkit.reporting.summary import format_summary
from ddpkit.reporting.throughput import Throughput, device_peak, format_flops, table_peak


@pytest.mark.parametrize(
    "name, precision, tf32, expected",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", False, (989.5, "H100 SXM, bf16 dense")),
        ("NVIDIA H100 80GB HBM3", "fp32", False, (67.0, "H100 SXM, fp32 dense")),
        ("NVIDIA H100 80GB HBM3", "fp32", True, (494.5, "H100 SXM, tf32 dense")),
        ("NVIDIA H100 PCIe", "bf16", False, (756.5, "H100 PCIe, bf16 dense")),
        ("NVIDIA H200", "bf16", False, (989.5, "H200 SXM, bf16 dense")),
        ("NVIDIA GH200 480GB", "fp16", False, (989.5, "GH200, fp16 dense")),
        ("NVIDIA A100-SXM4-80GB", "bf16", False, (312.0, "A100, bf16 dense")),
        ("NVIDIA A100-PCIE-40GB", "fp16", False, (312.0, "A100, fp16 dense")),
        ("NVIDIA L4", "bf16", False, (121.0, "L4, bf16 dense")),
        ("NVIDIA L40S", "bf16", False, (362.0, "L40S, bf16 dense")),
        ("Tesla V100-SXM2-16GB", "fp16", False, (125.0, "V100 SXM2, fp16 dense")),
        ("Tesla V100-PCIE-32GB", "fp16", False, (112.0, "V100 PCIe, fp16 dense")),
    ],
)
def test_the_table_names_the_dense_peak_of_a_gpu_at_the_runs_precision(name, precision, tf32, expected):
    assert table_peak(name, precision, tf32) == expected


def test_a_gpu_the_table_does_not_know_or_a_precision_it_lacks_has_no_peak():
    assert table_peak("NVIDIA A10G", "bf16") is None  # not the A10's figures
    assert table_peak("Tesla T4", "bf16") is None  # no bf16 units
    assert table_peak("NVIDIA GeForce GTX 1080", "fp32") is None


def test_on_a_cpu_there_is_a_peak_only_when_given():
    peak, why = device_peak(torch.device("cpu"), "bf16")
    assert peak is None and "--peak-tflops" in why
    assert device_peak(torch.device("cpu"), "bf16", 1.5) == (1.5, "--peak-tflops")


def test_the_rates_are_samples_per_s_times_what_a_sample_holds_over_the_devices():
    t = Throughput(flops_per_sample=3e9, tokens_per_sample=1024, devices=4, peak_tflops=100.0, peak_source="x")
    rates = t.rates(2000.0)
    assert rates["tokens_per_s"] == 2_048_000
    assert rates["tflops_per_device"] == pytest.approx(3e9 * 2000 / 4 / 1e12)  # 1.5
    assert rates["mfu"] == pytest.approx(0.015)
    assert t.rates(None) == {}
    assert Throughput().rates(100.0) == {}  # nothing counted: nothing beside samples/s
    assert "mfu" not in Throughput(flops_per_sample=1e6).rates(100.0)


def summary(throughput):
    return format_summary(
        {
            "world_size": 1,
            "nnodes": 1,
            "backend": "none",
            "device": "cuda:0",
            "batch_size": 8,
            "global_batch": 8,
            "epochs": 1,
            "epochs_done": 1,
            "train_loss": 3.0,
            "train_s": 10.0,
            "samples_per_s": 2000.0,
            "run_dir": "r",
            "throughput": throughput,
        }
    )


def test_the_summary_shows_tokens_per_s_and_the_compute_rate_with_its_mfu():
    t = Throughput(3e9, 1024, 4, 989.5, "H200 SXM, bf16 dense").summary(2000.0)
    text = summary(t)
    assert "  samples/s    2,000, 2,048,000 tokens/s (training 10.00 s)" in text
    assert (
        "  compute      1.5 TFLOP/s per device (3 GFLOP a sample), MFU 0.2% of 989.5 TFLOP/s (H200 SXM, bf16 dense)"
        in text
    )
    plain = summary(Throughput(4480.0, None, 1, None, "no peak").summary(2000.0))
    assert "  compute      8.96 MFLOP/s per device (4.48 kFLOP a sample)\n" in plain and "tokens/s" not in plain
    assert "compute" not in summary(Throughput(note="failed").summary(2000.0))


def test_the_epoch_line_adds_tokens_and_the_mfu_only_where_known():
    assert rates_text({"tokens_per_s": 12345.6}) == "  tokens/s 12,346"
    assert rates_text({"tflops_per_device": 1e-5}) == ""  # no peak: TFLOP/s stays in metrics.jsonl
    assert rates_text({"tokens_per_s": 1e6, "tflops_per_device": 312.4, "mfu": 0.3158}) == (
        "  tokens/s 1,000,000  TFLOP/s 312  mfu 31.6%"
    )
    assert format_flops(5.39e8) == "539 MFLOP" and format_flops(1.23e12, "/s") == "1.23 TFLOP/s"
