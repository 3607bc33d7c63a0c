"""--compile: which torch.compile backend runs, and what it compiles.

What: under FSDP/HSDP, and under DDP with activation checkpointing, each block's own
`forward` (the blocks FSDP shards or checkpointing recomputes: a transformer's layers) is
compiled, one block at a time, and the root (embeddings, head, loss) stays eager, as
torchtitan compiles per block. Only the forward is replaced, never the module: the hooks
around it (FSDP's all-gather and reduce-scatter, activation checkpointing's saved-tensor
hooks and recomputation) stay eager outside the compiled region, parameter names and
checkpoint keys stay what they were, and a recomputation runs the compiled forward again.
(`module.compile()` would compile `_call_impl`, and dynamo skips torch.nn's own frames: a
block that is an nn.Sequential of torch layers would compile nothing; `torch.compile(module)`
renames every parameter `_orig_mod.` and its graph ran no recomputation, measured on torch
2.13.) Blocks of the same class share one compiled graph (parameters are graph inputs).
DDP without checkpointing compiles the whole DDP model, as before (ddp_knobs.maybe_compile).

Which backend: inductor, torch's default, when it can build kernels here: on a CPU it needs
the C++ compiler torch._inductor.config.cpp.cxx names ($CXX, else g++), on a GPU triton and a
C compiler for triton's launcher. Without them, aot_eager: the same traced forward and
backward graphs run by torch's eager kernels (no speed-up, no new rounding), and the run says
which and why (rank 0's line, summary.json's "compile").
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn


@dataclass(frozen=True)
class CompileChoice:
    """The backend torch.compile gets, and why (summary.json's "compile")."""

    backend: str
    why: str


def choose_backend(device_type: str, *, path: str | None = None) -> CompileChoice:
    """inductor where it can build its kernels on `device_type`, else aot_eager, saying why.
    `path`: where to look for the compilers (default: $PATH)."""
    if device_type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return CompileChoice("aot_eager", "triton is not installed: inductor builds its GPU kernels with triton")
        cc = _first_found(_c_compilers(), path)
        if cc is None:
            return CompileChoice(
                "aot_eager", "no C compiler ($CC, cc, gcc, clang) on PATH: triton builds its kernel launcher with one"
            )
        return CompileChoice("inductor", f"the default: triton kernels (launcher built with {cc})")
    names = _cpp_compilers()
    cxx = _first_found(names, path)
    if cxx is None:
        return CompileChoice(
            "aot_eager",
            f"no C++ compiler ({' or '.join(names)}) on PATH: inductor builds its CPU kernels with one; "
            "install g++ (or set CXX) for inductor",
        )
    return CompileChoice("inductor", f"the default: C++ kernels built with {cxx}")


def _cpp_compilers() -> list[str]:
    """The C++ compilers inductor tries on a CPU, in its order ($CXX, else g++; clang++ on macOS)."""
    try:
        from torch._inductor import config as inductor_config

        names = [c for c in inductor_config.cpp.cxx if c]
    except Exception:  # an inductor whose config moved: the variable it has always read
        names = []
    return names or [os.environ.get("CXX", "g++")]


def _c_compilers() -> list[str]:
    cc = os.environ.get("CC")
    return [cc] if cc else ["cc", "gcc", "clang"]


def _first_found(names: Iterable[str], path: str | None) -> str | None:
    for name in names:
        if shutil.which(name, path=path) is not None:
            return name
    return None


def compile_forwards(blocks: Iterable[nn.Module], backend: str) -> int:
    """torch.compile each block's own forward (its hooks stay eager around it); returns how
    many. A block compiled already is left as it is."""
    count = 0
    for block in blocks:
        if not getattr(block.forward, "_ddpkit_compiled", False):
            compiled: Any = torch.compile(block.forward, backend=backend)
            compiled._ddpkit_compiled = True
            block.forward = compiled  # an instance attribute: nn.Module's __call__ runs it inside the hooks
        count += 1
    return count


def compiled_record(choice: CompileChoice, what: str, blocks: int = 0) -> dict[str, Any]:
    """summary.json's "compile": the backend, why, and what was compiled ("blocks": each
    block's forward, the root eager; "model": the whole model; "root": a model without blocks)."""
    record: dict[str, Any] = {"backend": choice.backend, "why": choice.why, "what": what}
    if what == "blocks":
        record["blocks"] = blocks
    return record
