"""How much of what a CPU worker freed it keeps: glibc's allocator and the memory plan.

glibc serves a block larger than its mmap threshold (128 KiB at first) with its own mapping
and unmaps it when freed; smaller blocks come from the heap, which it keeps for reuse. The
threshold is dynamic: each freed mapping raises it to that block's size (up to 32 MiB), so
after a few steps a training process serves its activations and gathered weights from the
heap and keeps their high-water mark: measured on the GPT example, peaks of 1.10-1.41x what
is live (1.25-2.63x with activation checkpointing, which frees and reallocates every block's
activations) and growing with the steps. A fixed threshold of 64 KiB (`mallopt`, the call
behind MALLOC_MMAP_THRESHOLD_) keeps every large tensor in a mapping of its own, returned when
freed: the peak is then what the memory plan counts, at a cost in speed (benchmarks/memory.py
measures it beside: each block's pages are faulted in again), so by default only a run sized to
its memory releases (--cpu-allocator auto). Set at run time, so it holds under any launcher (torchrun, srun, mpirun); a
MALLOC_MMAP_THRESHOLD_ in the environment is the user's choice and wins.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
RELEASE_THRESHOLD = 64 * 1024


def sized_to_memory(strategy: str, device_memory: object) -> bool:
    """Whether a run is sized to its memory: --strategy auto or --device-memory, where what the
    memory plan counts must hold (the run and its plan ask the same)."""
    return strategy == "auto" or device_memory is not None


def releases(mode: str, sized: bool) -> bool:
    """Whether --cpu-allocator `mode` releases: release, or auto for a run `sized` to its memory
    (--strategy auto or --device-memory: what the plan counts must hold). Releasing costs speed
    (every large block is mapped and its pages faulted in again: ~15-25% fewer samples/s on the
    GPT example, benchmarks/results/memory.md), so a run that is not sized keeps glibc's way."""
    return mode == "release" or (mode == "auto" and sized)


def release_freed_memory(mode: str = "release", sized: bool = True) -> bool:
    """When `releases(mode, sized)`, make this process return freed large blocks to the system
    (glibc only; elsewhere nothing changes). Returns whether freed memory is now released."""
    if not releases(mode, sized) or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return "MALLOC_MMAP_THRESHOLD_" in os.environ
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, RELEASE_THRESHOLD))
    except (OSError, AttributeError):  # not glibc (musl, macOS): its own policy stays
        return False


def resident_bytes() -> int:
    """This process's resident set now (Linux; 0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
