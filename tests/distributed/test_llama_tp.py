"""A transformers Llama built from a config (tests/distributed/scripts/llama_task.py: no download,
float64, SGD, grouped-query attention) trains under `ddpkit train --tp 2 --strategy fsdp` at 4
processes, a (dp_shard 2, tp 2) mesh, with no plan of the task's: ddpkit splits it by the model's
own `_tp_plan` (q/k/v, gate and up colwise, o and down rowwise, the embedding rowwise, the head
colwise with its logits gathered) and ends with every weight and each eval loss of the one-process
run. With the head tied to the embedding both split by vocabulary rows and stay one parameter
(an untied pair would train apart from the one-process model)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from conftest import REPO, load_model, run_ddpkit

TASK = str(REPO / "tests" / "distributed" / "scripts" / "llama_task.py") + ":build"
COMMON = ["--epochs", "1", "--max-steps", "3", "--seed", "7", "--threads", "1", "--quiet", "--save-every", "0"]
COMMON += ["--batch-size", "4", "--global-batch-size", "8"]


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("tie", ["False", "True"], ids=["untied", "tied-head"])
def test_llama_under_tp_2_by_its_own_plan_equals_one_process(reference_run, tmp_path, tie):
    args = [*COMMON, "--task-arg", f"tie={tie}"]
    one = reference_run(TASK, "--nproc", "1", *args)
    run = tmp_path / "tp"
    run_ddpkit("train", TASK, "--nproc", "4", "--tp", "2", "--strategy", "fsdp", *args, "--run-dir", str(run))
    split, whole = load_model(run), load_model(one)  # model.pt: the whole, unsplit weights
    assert split.keys() == whole.keys() and "lm_head.weight" in whole
    for name, weight in whole.items():
        assert split[name].shape == weight.shape, name
        assert torch.allclose(split[name], weight, atol=1e-9, rtol=0), name  # asked: 1e-4; measured ~1e-16
    if tie == "True":
        assert torch.equal(split["lm_head.weight"], split["model.embed_tokens.weight"])
    got, want = _records(run), _records(one)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want, strict=True):  # transformers' loss is float32: its rounding, not the split's
        assert abs(a["eval_loss"] - b["eval_loss"]) < 1e-6, (a, b)
    sys.path.insert(0, str(REPO / "tests" / "distributed" / "scripts"))
    from llama_task import build

    start = build(tie=tie == "True").model.state_dict()
    assert max((whole[k] - start[k]).abs().max().item() for k in whole) > 1e-3  # the steps moved the weights
