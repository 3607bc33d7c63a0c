"""--deterministic: the same kernels, in the same order, run after run on the same machine.

torch's defaults trade reproducibility for speed on a GPU: cuDNN's benchmark mode may pick a
different convolution algorithm in each process, some kernels add with atomics in whatever
order the threads finish, and cuBLAS may split a matmul's reduction over a workspace whose
size it chooses. With --deterministic every worker, before CUDA starts and before the model is
built, asks for deterministic cuDNN without benchmark mode, `torch.use_deterministic_algorithms`
(an op without a deterministic kernel then raises, naming itself) and a fixed cuBLAS workspace
(CUBLAS_WORKSPACE_CONFIG, read by cuBLAS when CUDA starts: set in the worker's environment
first). A run resumed from a checkpoint is then bit-identical to the uninterrupted one on a
GPU too (on a CPU it is already). It costs speed where the fast kernel was the non-deterministic
one. Leaving the block puts every setting back (an in-process run leaves no trace in its caller).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

from ..util.envvars import CUBLAS_WORKSPACE_VAR

CUBLAS_WORKSPACE = ":4096:8"  # torch's reproducibility notes: 8 buffers of 4 MiB (":16:8" is the other)
_DETERMINISTIC_WORKSPACES = (":4096:8", ":16:8")


@contextlib.contextmanager
def deterministic(on: bool) -> Iterator[None]:
    """Within the block, with `on`, deterministic kernels only (see the module docstring); else
    torch's settings as they are."""
    if not on:
        yield
        return
    before = (
        os.environ.get(CUBLAS_WORKSPACE_VAR),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    if before[0] not in _DETERMINISTIC_WORKSPACES:  # a user's deterministic value is kept
        os.environ[CUBLAS_WORKSPACE_VAR] = CUBLAS_WORKSPACE
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        workspace, cudnn_deterministic, benchmark, algorithms, warn_only = before
        if workspace is None:
            os.environ.pop(CUBLAS_WORKSPACE_VAR, None)
        else:
            os.environ[CUBLAS_WORKSPACE_VAR] = workspace
        torch.backends.cudnn.deterministic = cudnn_deterministic
        torch.backends.cudnn.benchmark = benchmark
        torch.use_deterministic_algorithms(algorithms, warn_only=warn_only)
