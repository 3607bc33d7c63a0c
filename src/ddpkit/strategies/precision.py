"""--precision: the compute dtype, refused where the hardware lacks it."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

from ..config.strategy import PRECISIONS
from ..errors import DdpkitError


def check_precision(precision: str, device_type: str) -> torch.dtype | None:
    """The compute dtype for --precision (None: fp32), refused where the hardware lacks it.

    bf16 on a CPU needs AVX512-BF16 or AMX: without them torch emulates bfloat16, which is
    slower than fp32 and defeats the point, so ddpkit refuses instead of falling back quietly.
    """
    if precision == "fp32":
        return None
    if precision == "fp16":
        if device_type != "cuda":
            raise DdpkitError(
                "--precision fp16 needs a CUDA GPU (fp16 autocast with a gradient scaler); on a CPU use "
                "--precision bf16 (CPUs with AVX512-BF16/AMX) or fp32"
            )
        return torch.float16
    if precision != "bf16":
        raise DdpkitError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if device_type == "cuda":
        # is_bf16_supported() also says yes where bf16 is only emulated (below compute capability 8.0)
        if not (torch.version.hip or torch.cuda.get_device_capability(torch.cuda.current_device()) >= (8, 0)):
            raise DdpkitError(
                "--precision bf16: this GPU has no bfloat16 support (it needs compute capability 8.0+); "
                "use --precision fp32"
            )
    elif not cpu_has_bf16():
        raise DdpkitError(
            "--precision bf16: this CPU has no native bfloat16 (AVX512-BF16 or AMX); torch would emulate it, "
            "slower than fp32. Use --precision fp32, or a GPU"
        )
    return torch.bfloat16


def cpu_has_bf16() -> bool:
    cpu = torch.cpu
    return bool(
        getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
        or getattr(cpu, "_is_amx_tile_supported", lambda: False)()
    )


def autocast(device_type: str, dtype: torch.dtype | None) -> ContextManager[Any]:
    """torch.autocast in `dtype` on this device type; nothing for fp32."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)
