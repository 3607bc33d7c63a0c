"""Throughput you can read: from the samples/s ddpkit already times, the tokens/s, the achieved
TFLOP/s per device and the MFU (model FLOPs utilisation: achieved / the device's peak).

The FLOPs of one sample are counted once, before training, from the real model
(training/flops.py); everything here is arithmetic on figures the loop already has, so it adds
no work to a step. The peak is the device's dense figure at the run's precision from the table
below, or --peak-tflops; on a CPU or a device the table does not know, there is no MFU unless
--peak-tflops gives the peak.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

# Dense (not sparse) peak TFLOP/s per device, from the vendors' datasheets: NVIDIA's figures
# "with sparsity" halved. Columns: fp32 (CUDA cores: torch's default for float32 matmuls),
# tf32 (tensor cores, used for float32 matmuls when torch.backends.cuda.matmul.allow_tf32 or
# torch.set_float32_matmul_precision("high"/"medium") says so), bf16 and fp16 (tensor cores,
# fp32 accumulation). None: the device has no such unit (V100 and T4 have no bf16).
# The first pattern that matches torch.cuda.get_device_name() wins: the specific before the general.
PEAK_TFLOPS: tuple[tuple[str, str, dict[str, float | None]], ...] = (
    (r"\bGH200\b", "GH200", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5}),
    (r"\bH200 NVL\b", "H200 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    (r"\bH200\b", "H200 SXM", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5}),
    (r"\bH100 NVL\b", "H100 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    (r"\bH100 PCIe\b", "H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5}),
    (r"\bH100\b", "H100 SXM", {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5}),
    (r"\bB200\b", "B200", {"fp32": 75.0, "tf32": 1125.0, "bf16": 2250.0, "fp16": 2250.0}),
    (r"\bA100\b", "A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    (r"\bA10\b", "A10", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    (r"\bL40S\b", "L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.0, "fp16": 362.0}),
    (r"\bL40\b", "L40", {"fp32": 90.5, "tf32": 90.5, "bf16": 181.0, "fp16": 181.0}),
    (r"\bL4\b", "L4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
    (r"\bV100-PCIE", "V100 PCIe", {"fp32": 14.0, "tf32": None, "bf16": None, "fp16": 112.0}),
    (r"\bV100\b", "V100 SXM2", {"fp32": 15.7, "tf32": None, "bf16": None, "fp16": 125.0}),
    (r"\bT4\b", "T4", {"fp32": 8.1, "tf32": None, "bf16": None, "fp16": 65.0}),
    (r"\bMI300X\b", "MI300X", {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4}),
)


def table_peak(device_name: str, precision: str, tf32: bool = False) -> tuple[float, str] | None:
    """The dense peak TFLOP/s of a device named `device_name` at `precision` (fp32, bf16,
    fp16; fp32 with `tf32`: its tf32 column) and how it is named ("H100 SXM, bf16 dense"),
    or None when the table has no figure for it."""
    column = "tf32" if precision == "fp32" and tf32 else precision
    for pattern, name, figures in PEAK_TFLOPS:
        if re.search(pattern, device_name, re.IGNORECASE):
            peak = figures.get(column)
            return (peak, f"{name}, {column} dense") if peak else None
    return None


def device_peak(device: torch.device, precision: str, given: float | None = None) -> tuple[float | None, str]:
    """The peak TFLOP/s per device the MFU is taken against, and where it comes from: `given`
    (--peak-tflops) wins; a GPU the table knows; else none, and why."""
    if given is not None:
        return float(given), "--peak-tflops"
    if device.type != "cuda":
        return None, f"no peak for a {device.type} device (--peak-tflops gives one)"
    name = torch.cuda.get_device_name(device)
    tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    found = table_peak(name, precision, tf32)
    if found is None:
        return None, f"no {precision} peak known for {name} (--peak-tflops gives one)"
    return found


def significant(x: float, digits: int = 6) -> float:
    return float(f"{x:.{digits}g}")


@dataclass(frozen=True)
class Throughput:
    """What turns samples/s into the other figures: the FLOPs of one sample's forward and
    backward (None: not counted, `note` says why), the tokens a sample holds (None: no token
    dimension), the devices the work is spread over and the peak of one (None: no MFU)."""

    flops_per_sample: float | None = None
    tokens_per_sample: int | None = None
    devices: int = 1
    peak_tflops: float | None = None
    peak_source: str = ""  # "H100 SXM, bf16 dense", "--peak-tflops", or why there is no peak
    note: str = ""  # why the FLOPs were not counted (or were estimated from a config)

    def rates(self, samples_per_s: float | None) -> dict[str, Any]:
        """The figures beside a samples/s (global, all ranks): tokens/s, TFLOP/s per device, MFU
        (those that can be had)."""
        out: dict[str, Any] = {}
        if not samples_per_s:
            return out
        if self.tokens_per_sample:
            out["tokens_per_s"] = significant(samples_per_s * self.tokens_per_sample)
        if self.flops_per_sample:
            tflops = self.flops_per_sample * samples_per_s / self.devices / 1e12
            out["tflops_per_device"] = significant(tflops)
            if self.peak_tflops:
                out["mfu"] = significant(tflops / self.peak_tflops)
        return out

    def summary(self, samples_per_s: float | None) -> dict[str, Any]:
        """summary.json's "throughput": the run's rates and what they are made of."""
        rates = self.rates(samples_per_s)
        out = {
            "samples_per_s": samples_per_s,
            "tokens_per_s": rates.get("tokens_per_s"),
            "tokens_per_sample": self.tokens_per_sample,
            "flops_per_sample": self.flops_per_sample,
            "tflops_per_device": rates.get("tflops_per_device"),
            "devices": self.devices,
            "mfu": rates.get("mfu"),
            "peak_tflops": self.peak_tflops,
            "peak_source": self.peak_source,
        }
        if self.note:
            out["flops_note"] = self.note
        return out


def format_flops(flops: float, per: str = "") -> str:
    """`6.1 kFLOP`, `1.23 TFLOP/s` (per="/s"): three significant figures and an SI prefix."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(flops) >= factor:
            return f"{flops / factor:.3g} {prefix}FLOP{per}"
    return f"{flops:.3g} FLOP{per}"


def compute_line(t: dict[str, Any]) -> str | None:
    """The summary's line of the compute rate: `1.23 TFLOP/s per device (539 MFLOP a sample),
    MFU 12.4% of 989.5 TFLOP/s (H200 SXM, bf16 dense)`; None without a FLOP count."""
    if not t.get("flops_per_sample") or t.get("tflops_per_device") is None:
        return None
    line = (
        f"{format_flops(t['tflops_per_device'] * 1e12, '/s')} per device "
        f"({format_flops(t['flops_per_sample'])} a sample)"
    )
    if t.get("mfu") is not None:
        line += f", MFU {t['mfu']:.1%} of {t['peak_tflops']:g} TFLOP/s ({t['peak_source']})"
    if str(t.get("flops_note", "")).startswith("estimated"):
        line += "; FLOPs estimated from the model's config"
    return line
