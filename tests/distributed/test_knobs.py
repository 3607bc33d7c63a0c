"""Performance knobs: each one trains, and its result equals plain DDP within the tolerance
tuning.py documents for it. `ddpkit bench` prints a parseable table. Bad values are refused."""

import json
import subprocess
import sys

import pytest

from conftest import REPO, assert_state_close, load_model, max_abs_diff, run_ddpkit

COMMON = ["--nproc", "2", "--epochs", "3", "--save-every", "0", "--eval-every", "3", "--quiet", "--seed", "0"]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Plain DDP: 2 processes x batch 16 (global 32)."""
    d = tmp_path_factory.mktemp("plain")
    run_ddpkit("train", *COMMON, "--batch-size", "16", "--run-dir", str(d / "run"), cwd=d)
    return d / "run"


def _train(tmp_path, *flags):
    run_ddpkit("train", *COMMON, *flags, "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    return tmp_path / "run"


def _loss(run_dir):
    return json.loads((run_dir / "summary.json").read_text())["train_loss"]


def test_accumulate_k_micro_batches_equals_k_times_the_batch(tmp_path, plain):
    # batch 4 x 4 micro-batches per optimizer step == batch 16; Wine's short last global batch
    # (142 = 4 x 32 + 14) is split into uneven micro-batches, one of them empty on a rank
    run = _train(tmp_path, "--batch-size", "4", "--accumulate", "4")
    assert_state_close(load_model(run), load_model(plain), rtol=1e-5, atol=1e-6)
    assert json.loads((run / "summary.json").read_text())["global_batch"] == 32


@pytest.mark.parametrize(
    "flags",
    [
        ["--bucket-mb", "0.001", "--static-graph"],  # many tiny buckets: same sums
        ["--fused-optimizer", "on"],  # fused Adam: another rounding
    ],
)
def test_exact_knobs_match_plain_ddp(tmp_path, plain, flags):
    run = _train(tmp_path, "--batch-size", "16", *flags)
    assert_state_close(load_model(run), load_model(plain), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method, tol", [("fp16", 2e-3), ("bf16", 2e-2), ("powersgd", 5e-2)])
def test_gradient_compression_is_close_to_plain_ddp(tmp_path, plain, method, tol):
    run = _train(tmp_path, "--batch-size", "16", "--grad-compression", method)
    assert max_abs_diff(load_model(run), load_model(plain)) < tol
    assert abs(_loss(run) - _loss(plain)) < 0.02 * _loss(plain) + tol


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--accumulate", "0"], "--accumulate must be a positive integer"),
        (["--bucket-mb", "-1"], "--bucket-mb must be a positive number"),
        (["--grad-compression", "zip"], "invalid choice"),
        (["--fused-optimizer", "maybe"], "invalid choice"),
    ],
)
def test_bad_knob_values_are_refused(tmp_path, flags, fragment):
    proc = run_ddpkit("train", *flags, "--epochs", "1", cwd=tmp_path, check=False, timeout=60)
    assert proc.returncode == 2
    assert fragment in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bench_prints_a_parseable_table(tmp_path):
    out = run_ddpkit(
        "bench",
        "--nproc",
        "1,2",
        "--sizes",
        "4,64K",
        "--iters",
        "3",
        "--steps",
        "3",
        "--json",
        str(tmp_path / "b.json"),
        cwd=tmp_path,
    ).stdout
    rows = [line.split() for line in out.splitlines() if line.strip() and not line.startswith("#")]
    allreduce = [r for r in rows if len(r) == 6]
    steps = [r for r in rows if len(r) == 12]
    # gloo's table, then ddpkit's shared-memory path (CPU ranks on one machine)
    assert [int(r[1]) for r in allreduce] == [4, 65536, 4, 65536]
    assert "shared memory" in out
    assert all(float(r[4]) > 0 and float(r[5]) > 0 for r in allreduce)  # algbw, busbw
    assert [(int(r[0]), r[2]) for r in steps] == [(1, "none"), (2, "shm")]
    for r in steps:
        data, compute, comm = float(r[5]), float(r[6]), float(r[7])
        assert float(r[3]) > 0 and data >= 0 and compute > 0 and comm >= 0
        assert abs(float(r[8]) + float(r[9]) + float(r[10]) - 100) < 0.5  # shares add up
    assert float(steps[0][7]) == 0  # nothing to communicate with one process
    report = json.loads((tmp_path / "b.json").read_text())
    assert [r["world_size"] for r in report["results"]] == [1, 2]


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--nproc", "0"], "--nproc must be a comma-separated list"),
        (["--sizes", "2"], "--sizes must be byte counts"),
        (["--what", "everything"], "--what must be"),
        (["no_such_task"], "unknown task"),
    ],
)
def test_bench_bad_values_are_refused(tmp_path, args, fragment):
    proc = run_ddpkit("bench", *args, cwd=tmp_path, check=False, timeout=60)
    assert proc.returncode == 2
    assert fragment in proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_and_cli_import_no_torch():
    code = "import sys, ddpkit.cli; ddpkit.cli.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONPATH": str(REPO / "src")}
    ).stdout
    assert out.strip() == "False"
