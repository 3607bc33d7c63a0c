"""A rank that runs out of memory ends the job in a few lines (which rank, in which phase, at
which step, how much it tried to allocate, the settings to try), no traceback; the checkpoint
before it stays and --resume with a setting that fits continues.

The memory is limited for real, per process, by RLIMIT_DATA (what `prlimit --data` sets): the
launcher and its workers inherit it, and torch's CPU allocator then fails with "can't allocate
memory: you tried to allocate N bytes", a RuntimeError, on the worker's main thread. Measured
with examples/gpt.py (its default 0.1M-parameter model, --threads 1) at 1000 MiB: a micro-batch
of 512 windows trains (peak resident set ~840 MiB), one of 1024 fails in its first forward or
backward (it needs ~1.2 GiB); the launcher itself needs far less. The gloo threads did not
abort in these runs (their buffers are small next to the activations); a limit low enough to
fail an allocation on one of them was not tried (a C++ thread's failure would likely abort the
process, which the launcher reports as a signal, not as these lines).
The outcome does not depend on the machine's load (a limit per process, no timeout).
One rank alone failing inside an FSDP unit is a request of 40 TB, which fails without a limit.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from ddpkit.checkpoint.file import load_file

LIMIT = 1000 * 2**20  # bytes of RLIMIT_DATA per process
GPT = [str(REPO / "examples" / "gpt.py") + ":build", "--nproc", "2", "--threads", "1"]
GPT += ["--task-arg", "max_samples=4096"]  # 2 steps of 2048 per epoch
TOO_BIG = ["--batch-size", "1024"]  # a global batch of 2048 in micro-batches of 1024
FITS = ["--batch-size", "512", "--accumulate", "2"]  # the same global batch: what the message suggests

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_DATA limits allocations on Linux only")


def _limited(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`ddpkit train ARGS` with every process's data segment limited to LIMIT."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (LIMIT, LIMIT))

    return subprocess.run(
        [sys.executable, "-m", "ddpkit", "train", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit,
    )


def _said(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def test_out_of_memory_ends_in_a_few_lines_that_say_what_to_try(tmp_path: Path) -> None:
    proc = _limited(*GPT, *TOO_BIG, "--max-steps", "2", "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, _said(proc)
    assert "Traceback" not in out and len(out.splitlines()) < 25, _said(proc)
    head = re.search(
        r"ddpkit: error: rank ([01]) ran out of memory in (forward|backward) at step 1: "
        r"it tried to allocate [0-9.]+ (KiB|MiB|GiB); its model state is [0-9.]+ (KiB|MiB) per rank \(ddp: ",
        proc.stderr,
    )
    assert head, _said(proc)
    assert "    --batch-size 512 --accumulate 2 (the same global batch in smaller micro-batches)" in out
    assert "    --activation-checkpointing (" in out and "    --strategy fsdp (" in out
    assert "see the memory plan: ddpkit plan " in out and "--nproc 2 --batch-size 1024" in out
    failed = (tmp_path / "run" / "failed.json").read_text()  # the first rank to record its failure
    assert re.search(r"rank [01] ran out of memory in (forward|backward) at step 1", failed), failed


ONE_RANK = """
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, {examples!r})
from gpt import build


def task(config=None, **kw):
    t = build(config, **kw)
    calls = []

    # rank 1's third call of the block (step 2's forward: step 1's backward recomputed it) asks for 40 TB
    def allocate(module, args):
        if module.training:
            calls.append(1)
            if dist.get_rank() == 1 and len(calls) == 3:
                torch.empty(10**13)

    t.model.blocks[0].register_forward_pre_hook(allocate)
    return t
"""


def test_one_rank_out_of_memory_inside_a_sharded_block_is_said_alone(tmp_path: Path) -> None:
    """Rank 1 alone fails an allocation inside an FSDP unit with activation checkpointing (no
    limit needed: 40 TB): its lines, no traceback, and none of torch's warnings for the forward
    hooks (FSDP's post-forward) that fail after it."""
    (tmp_path / "one_rank.py").write_text(ONE_RANK.format(examples=str(REPO / "examples")))
    args = ["one_rank.py:task", "--nproc", "2", "--threads", "1", "--max-steps", "4", "--batch-size", "16"]
    proc = subprocess.run(
        [sys.executable, "-m", "ddpkit", "train", *args, "--strategy", "fsdp", "--activation-checkpointing"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, _said(proc)
    assert "Traceback" not in out and "Warning" not in out, _said(proc)
    assert re.search(r"ddpkit: error: rank 1 ran out of memory in forward at step 2: it tried to allocate ", out)
    assert "ran out of memory too" not in out and len(out.splitlines()) < 12, _said(proc)


def test_the_checkpoint_before_an_out_of_memory_resumes_with_a_setting_that_fits(tmp_path: Path) -> None:
    run = ["--run-dir", str(tmp_path / "run"), "--save-every-steps", "1"]
    first = _limited(*GPT, *FITS, "--max-steps", "2", *run, cwd=tmp_path)
    assert first.returncode == 0, _said(first)
    checkpoints = tmp_path / "run" / "checkpoints"
    before = {p.name: p.stat().st_mtime_ns for p in checkpoints.iterdir()}

    failed = _limited(*GPT, *TOO_BIG, "--max-steps", "4", "--resume", *run, cwd=tmp_path)
    assert failed.returncode == 1, _said(failed)
    assert re.search(r"rank [01] ran out of memory in (forward|backward) at step 3: ", failed.stderr), _said(failed)
    assert f"--resume continues from the last checkpoint in {checkpoints}" in failed.stderr
    assert {p.name: p.stat().st_mtime_ns for p in checkpoints.iterdir()} == before  # nothing partial, nothing new
    newest = max(before)  # epoch-000001.pt: step 2, the end of epoch 1
    assert load_file(checkpoints / newest)["global_step"] == 2  # whole: every record passes its CRC-32

    resumed = _limited(*GPT, *FITS, "--max-steps", "4", "--resume", *run, cwd=tmp_path)
    assert resumed.returncode == 0, _said(resumed)
    assert f"resuming from {checkpoints / newest}" in resumed.stdout + resumed.stderr
    assert "steps 4/4" in resumed.stdout


def test_batch_size_auto_fits_under_the_limit_trains_and_a_resume_keeps_it(tmp_path: Path) -> None:
    """Under the same limit --batch-size auto picks a micro-batch below the 1024 that fails above
    (bounded by memory, not by the 2048 samples per process), trains, and records it; a resume
    without the limit, where a larger one would fit, keeps it (another would change the results)."""
    run = str(tmp_path / "run")
    proc = _limited(*GPT, "--batch-size", "auto", "--max-steps", "2", "--run-dir", run, cwd=tmp_path)
    assert proc.returncode == 0, _said(proc)
    said = re.search(r"ddpkit: --batch-size auto: (\d+) per process \(bounded by memory; planned peak ", proc.stdout)
    assert said and "measured " in proc.stdout, _said(proc)
    chosen = int(said.group(1))
    assert 64 <= chosen < 1024, _said(proc)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["batch_size"] == chosen and summary["global_batch"] == 2 * chosen and summary["steps_done"] == 2
    assert json.loads((tmp_path / "run" / "config.json").read_text())["batch_size"] == chosen
    resumed = subprocess.run(
        [sys.executable, "-m", "ddpkit", "train", *GPT, "--batch-size", "auto", "--max-steps", "3"]
        + ["--run-dir", run, "--resume"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert resumed.returncode == 0, _said(resumed)
    assert f"ddpkit: --batch-size auto: {chosen} per process, kept from the run being resumed" in resumed.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["batch_size"] == chosen and summary["steps_done"] == 3
