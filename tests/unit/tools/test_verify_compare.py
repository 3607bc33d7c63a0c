"""ddpkit verify's pure parts: which setups share the global batch, how two traces are
compared (drift per parameter, the first step over the tolerance, the judged steps), the
evaluation check, the float64 cast, and the refusals before any run."""

import pytest
import torch
from torch import nn

from ddpkit.errors import DdpkitError
from ddpkit.tools.verify import Setup, compare, eval_differences, plan_setups, verify
from ddpkit.tools.verify_report import Comparison, Evidence, diagnose
from ddpkit.training.trace import dropout_off, to_float64, trace_file


def test_every_setup_has_the_users_global_batch():
    assert plan_setups(2, 32, 1) == [Setup(1, 64), Setup(2, 32), Setup(1, 32, 2)]
    assert plan_setups(4, 4, 2) == [Setup(1, 32), Setup(4, 4, 2), Setup(1, 16, 2)]
    assert plan_setups(3, 3, 1) == [Setup(1, 9), Setup(3, 3)]  # an odd global batch cannot be halved
    for s in plan_setups(4, 4, 2):
        assert s.nproc * s.batch_size * s.accumulate == 32
    assert Setup(1, 16, 2).label == "1 x 16 accumulate 2"


def _trace(run_dir, steps):
    for step, state in enumerate(steps, start=1):
        trace_file(run_dir, step).parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, trace_file(run_dir, step))


def test_compare_names_the_largest_drift_per_parameter_and_the_first_step_over_the_tolerance(tmp_path):
    w = torch.ones(3, dtype=torch.float64)
    ref = [{"w": w, "b": w, "n": torch.tensor(1)} for _ in range(3)]
    other = [
        {"w": w + 1e-15, "b": w, "n": torch.tensor(2)},  # rounding; an integer buffer is not compared
        {"w": w, "b": w + 1e-3, "n": torch.tensor(2)},
        {"w": w + 5e-3, "b": w + 1e-2, "n": torch.tensor(2)},
    ]
    _trace(tmp_path / "ref", ref)
    _trace(tmp_path / "other", other)
    c = compare(tmp_path / "ref", tmp_path / "other", range(1, 4), range(1, 4), 1e-9, "2 x 8", "1 x 16")
    assert c.first[:2] == (2, "b") and c.first[2] == pytest.approx(1e-3)
    assert c.drift["w"] == pytest.approx(5e-3) and c.drift["b"] == pytest.approx(1e-2)
    assert "n" not in c.drift
    # judged on step 1 only (float32): the later drift is shown, not counted
    only_first = compare(tmp_path / "ref", tmp_path / "other", range(1, 4), range(1, 2), 1e-9, "2 x 8", "1 x 16")
    assert only_first.first is None and only_first.drift["b"] == pytest.approx(1e-2)
    assert c.first_over == ["b"]  # every tensor over the tolerance at the first step over it
    line, code = diagnose(Evidence(c, None, _within("resumed")))
    assert "NOT exact: b drifts by 1.00e-03 at step 2 (2 x 8 vs 1 x 16)" in line and "Task.step" in line
    assert code == 1


def test_a_missing_step_of_a_trace_is_named(tmp_path):
    _trace(tmp_path / "ref", [{"w": torch.zeros(1)}] * 2)
    _trace(tmp_path / "short", [{"w": torch.zeros(1)}])
    with pytest.raises(DdpkitError, match="short wrote no parameters for step 2"):
        compare(tmp_path / "ref", tmp_path / "short", range(1, 3), range(1, 3), 1e-9, "a", "b")


def test_an_evaluation_that_differs_beyond_rounding_is_reported():
    ref, user = Setup(1, 64), Setup(2, 32)
    same = {ref: {"eval_loss": 0.5, "eval_accuracy": 0.9}, user: {"eval_loss": 0.5 + 1e-12, "eval_accuracy": 0.9}}
    assert eval_differences(same, ref, 1e-7) == []
    off = {ref: {"eval_loss": 0.5, "eval_accuracy": 0.9}, user: {"eval_loss": 0.5, "eval_accuracy": 1.8}}
    assert eval_differences(off, ref, 1e-7) == ["eval_accuracy 1.8 at 2 x 32, 0.9 at 1 x 64"]
    evidence = Evidence(_within("2 x 32"), None, _within("resumed"), eval_differences(off, ref, 1e-7))
    assert "metric must return the batch's SUM" in diagnose(evidence)[0] and diagnose(evidence)[1] == 1


def _within(label):
    return Comparison(label, "1 x 64", range(1, 5), {"w": 0.0})


def _over(label, step, *names):
    return Comparison(label, "1 x 64", range(1, 5), {"w": 1.0}, (step, names[0], 1e-3), list(names))


@pytest.mark.parametrize(
    "evidence, code, said",
    [
        (Evidence(_within("2 x 32"), _within("acc"), _within("resumed")), 0, "exact: the same parameters"),
        (  # a correct model with nn.Dropout: exact with it off, and said so
            Evidence(_within("2 x 32"), _within("acc"), _within("resumed"), dropout_off=["drop"]),
            0,
            "(with the model's dropout off: drop; dropout draws its masks per process",
        ),
        (
            Evidence(
                _over("2 x 32", 1, "fc.weight", "bn.running_mean"), _over("acc", 1, "bn.running_var"), _within("r")
            ),
            1,
            "BatchNorm's running statistics drift first (bn.running_mean at step 1, 2 x 32 vs 1 x 64)",
        ),
        (
            Evidence(_over("2 x 32", 2, "fc.weight"), _within("acc"), _within("r")),
            1,
            "accumulating 2 micro-batches is exact but 2 x 32 is not: something is computed per process",
        ),
        (
            Evidence(_over("2 x 32", 1, "fc.weight"), _over("acc", 1, "fc.weight"), _within("r")),
            1,
            "a loss averaged per micro-batch",
        ),
        (
            Evidence(_within("2 x 32"), _within("acc"), _over("resumed at step 3", 4, "fc.weight")),
            1,
            "only the resumed run drifts (fc.weight by 1.00e-03 at step 4",
        ),
        (
            Evidence(_over("2 x 32", 1, "fc.weight"), _over("acc", 1, "fc.weight"), _within("r"), draws_matter=True),
            3,
            "cannot judge: fc.weight drifts by 1.00e-03 at step 1 (2 x 32 vs 1 x 64), and 1 x G with other random",
        ),
    ],
    ids=["exact", "dropout", "batchnorm", "per-rank", "per-micro-batch", "checkpoint", "randomness"],
)
def test_the_verdict_names_the_cause_the_evidence_points_to(evidence, code, said):
    line, got = diagnose(evidence)
    assert said in line and got == code, line


def test_dropout_off_turns_every_dropout_module_off_and_names_them():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Sequential(nn.Dropout2d(0.1), nn.AlphaDropout(0.2)))
    model.add_module("none", nn.Dropout(0.0))
    assert dropout_off(model) == ["1", "2.0", "2.1"]
    x = torch.ones(8, 4)
    assert torch.equal(model(x), model(x))  # no mask drawn in training mode


def test_to_float64_casts_the_model_and_its_floating_inputs_and_keeps_the_parameters():
    model = nn.Linear(3, 2)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    to_float64(model)
    assert [p is q for p, q in zip(model.parameters(), params, strict=True)] == [True, True]
    out = model(torch.ones(4, 3))  # a float32 input, cast on the way in
    assert out.dtype == torch.float64
    out.sum().backward()
    optimizer.step()  # the optimizer the task built still holds (and updates) them
    assert model.weight.dtype == torch.float64 and model.weight.grad is not None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"nproc": 1}, "--nproc 1 compares nothing"),
        ({"steps": 2}, "--steps 2: verify needs at least 3"),
        ({"task": "nope"}, "unknown task 'nope'"),
    ],
)
def test_verify_refuses_bad_input_before_any_run(kwargs, message):
    steps = kwargs.pop("steps", 4)
    with pytest.raises(DdpkitError, match=message):
        verify(device="cpu", steps=steps, **{"nproc": 2, **kwargs})


def test_verify_refuses_a_run_dir_that_holds_something(tmp_path):
    (tmp_path / "old").write_text("x")
    with pytest.raises(DdpkitError, match="is not empty"):
        verify(device="cpu", nproc=2, run_dir=str(tmp_path), steps=4)
