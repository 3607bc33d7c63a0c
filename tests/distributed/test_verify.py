"""`ddpkit verify` through the real CLI: a task that averages its padded token loss per
micro-batch drifts and is named (exit 1); an exact task that refuses float64 is compared in
float32, says so, and passes (exit 0); each cause verify tells apart (dropout, BatchNorm, a
per-process reduction, state missing from the checkpoint, other randomness) is named; bad
input is one line (exit 2). (Wine's float64 pass
is the guide's example, run by tests/docs/test_guide.py.)"""

import pytest

from conftest import REPO, run_ddpkit

SCRIPTS = REPO / "tests" / "distributed" / "scripts"
PARAMS = ("embed.weight", "mix.weight", "mix.bias", "head.weight", "head.bias")


def _verify(script):
    """ddpkit verify of a task in tests/distributed/scripts (FILE or FILE:FUNCTION, build by
    default): 2 x 8 against 1 x 16, 4 steps."""
    task = f"{SCRIPTS / script}" if ":" in script else f"{SCRIPTS / script}:build"
    return run_ddpkit("verify", task, "--nproc", "2", "--batch-size", "8", "--steps", "4", check=False)


@pytest.mark.slow
def test_a_loss_averaged_per_micro_batch_over_padded_tokens_drifts_and_is_named():
    proc = _verify("padded_mean_task.py")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "in float64" in out
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith("ddpkit verify: NOT exact: ")
    assert any(f"NOT exact: {p} drifts by" in verdict for p in PARAMS), verdict
    assert "(loss_sum, count) from Task.step" in verdict
    assert "2 x 8 vs 1 x 16 (steps 1-4): first over at step" in out
    assert "1 x 8 accumulate 2 vs 1 x 16 (steps 1-4): first over at step" in out
    # the checkpoint round trip is exact even for this task: same world size, same arithmetic
    assert "resumed at step 3 vs 2 x 8 uninterrupted (steps 4-4): within tolerance" in out
    for p in PARAMS:
        assert any(line.split()[:1] == [p] for line in out.splitlines()), p


@pytest.mark.slow
def test_an_exact_task_that_refuses_float64_is_compared_in_float32_and_passes():
    proc = _verify("float32_task.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "the task fails in float64 (RuntimeError: " in out
    assert "in float32 (the task fails in float64): only steps 1-2 are judged" in out
    assert "are judged, as Adam lets float32 rounding grow, deterministic kernels; tolerance" in out  # every run's
    assert out.strip().splitlines()[-1].startswith("ddpkit verify: exact:")
    assert "Traceback" not in proc.stderr  # the float64 probe's failure is one line, not every rank's traceback


def test_bad_input_is_one_line_and_exit_2():
    proc = run_ddpkit("verify", "wine", "--nproc", "1", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "ddpkit: error: ddpkit verify compares 1 process with --nproc N: --nproc 1 compares nothing (use 2+)"
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "task, code, said",
    [
        (
            "with_dropout",
            0,
            "ddpkit verify: exact: the same parameters at every step, world size, accumulation and after a resume "
            "(with the model's dropout off: 0; dropout draws its masks per process",
        ),
        ("with_batchnorm", 1, "ddpkit verify: NOT exact: BatchNorm's running statistics drift first (0.running_"),
        ("divided_by_world", 1, "accumulating 2 micro-batches is exact but 2 x 8 is not: something is computed per"),
        ("forgets_state", 1, "ddpkit verify: NOT exact: only the resumed run drifts ("),
        ("noisy_inputs", 3, "ddpkit verify: cannot judge: inner.0.weight drifts by"),
    ],
)
def test_the_verdict_names_the_cause_and_exits_1_only_for_what_the_task_can_fix(task, code, said):
    """One small task per cause (scripts/verify_causes.py): the verdict names it; a correct model
    with nn.Dropout is exact with it off (exit 0), randomness verify cannot turn off is 3."""
    proc = _verify(f"verify_causes.py:{task}")
    verdict = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert said in verdict, verdict
    assert "Traceback" not in proc.stderr
