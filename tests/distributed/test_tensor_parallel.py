"""Tensor parallelism applied by ddpkit's plan (strategies/tensor_parallel.py) trains the same
model as one process: a nanoGPT-shaped two-block model of separate q/k/v, split over 2 tp ranks
on gloo, 5 float64 SGD steps, every weight within 1e-9 of the unsplit run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).parent / "scripts" / "tp_gpt_steps.py"


def _run(tmp_path: Path, nproc: int) -> dict:
    out = tmp_path / f"tp{nproc}.pt"
    if nproc == 1:
        cmd = [sys.executable, str(SCRIPT), str(out)]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(SCRIPT),
            str(out),
        ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[:6000]
    return torch.load(out, weights_only=True)


def test_two_tp_ranks_train_what_one_process_trains(tmp_path):
    one, two = _run(tmp_path, 1), _run(tmp_path, 2)
    assert one["weights"].keys() == two["weights"].keys()
    for name, weight in one["weights"].items():
        assert two["weights"][name].shape == weight.shape, name
        assert torch.allclose(two["weights"][name], weight, atol=1e-9, rtol=0), name
    assert abs(float(two["loss"]) - float(one["loss"])) < 1e-9
    moved = max((one["weights"][k] - w0).abs().max() for k, w0 in _initial().items())
    assert moved > 1e-3  # the steps moved the weights: equal runs that trained nothing would prove nothing


def _initial() -> dict:
    sys.path.insert(0, str(Path(__file__).parents[1] / "unit" / "strategies"))
    from test_tensor_parallel_plan import Gpt

    torch.manual_seed(0)
    with torch.device("cpu"):
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            return {k: v.clone() for k, v in Gpt().state_dict().items()}
        finally:
            torch.set_default_dtype(default)
