"""--strategy hsdp on one machine through the real CLI (gloo on CPU): 2 replicas x 2 shards train
to the 4-process DDP run's parameters (with micro-batches and clipping), and its sharded
checkpoints cross to FSDP and DDP at another world size, and back."""

import json
import shutil

import pytest
import torch

import ddpkit
from conftest import assert_state_close, load_model, run_ddpkit

# global batch 64 at every world size (4 x 16, 4 x 8 x 2 micro-batches, 2 x 32): the same steps
COMMON = ["--seed", "5", "--save-every", "2", "--epochs", "6", "--clip-grad-norm", "0.5", "--quiet"]
HSDP = ["--strategy", "hsdp", "--replicate", "2", "--nproc", "4", "--batch-size", "8", "--accumulate", "2"]
CLOSE = dict(rtol=1e-6, atol=1e-7)  # 4 ranks' summation orders differ: reduce-scatter + all-reduce vs all-reduce


@pytest.fixture(scope="module")
def runs(tmp_path_factory, reference_run):
    hsdp = tmp_path_factory.mktemp("hsdp") / "run"
    proc = run_ddpkit("train", *HSDP, *COMMON[:-1], "--run-dir", str(hsdp))
    (hsdp.parent / "out.txt").write_text(proc.stdout)
    return {"ddp": reference_run("--nproc", "4", "--batch-size", "16", *COMMON), "hsdp": hsdp}


def _resume(source, run, *args):
    (run / "checkpoints").mkdir(parents=True)
    (shutil.copytree if source.is_dir() else shutil.copy)(source, run / "checkpoints" / source.name)
    proc = run_ddpkit("train", *args, *COMMON[:-1], "--resume", "--run-dir", str(run))
    assert f"resuming from {run / 'checkpoints' / source.name}" in proc.stdout
    (run / "out.txt").write_text(proc.stdout)
    return load_model(run)


@pytest.mark.slow  # its fixture trains two 4-process runs
def test_hsdp_trains_to_the_4_process_ddp_runs_parameters(runs):
    ddp, hsdp = load_model(runs["ddp"]), load_model(runs["hsdp"])
    assert_state_close(hsdp, ddp, **CLOSE)
    assert all((hsdp[k] - ddp[k]).abs().max() < 1e-6 for k in ddp)
    # clipping saw the norm over both shards, each replica counted once (every step is clipped: norm > 0.5)
    norms = {
        name: [json.loads(r)["grad_norm"] for r in (runs[name] / "metrics.jsonl").read_text().splitlines()]
        for name in runs
    }
    assert all(n > 0.5 for n in norms["ddp"]) and norms["hsdp"] == pytest.approx(norms["ddp"], rel=1e-5)
    out = (runs["hsdp"].parent / "out.txt").read_text()
    assert "ddpkit: --strategy hsdp: 2 replicas x 2 shards" in out and "strategy     hsdp, fp32" in out
    summary = json.loads((runs["hsdp"] / "summary.json").read_text())
    assert summary["strategy"] == "hsdp" and summary["world_size"] == 4
    # every rank holds one of 2 shards of the model and its optimizer state, as the plan says
    plan = ddpkit.memory_plan("wine", nproc=4, strategy="hsdp", replicate=2)
    assert plan.mesh == (2, 2) and summary["state_bytes_per_rank"]["total"] == plan.hsdp.state
    assert plan.hsdp.state < plan.ddp.state
    ckpt = runs["hsdp"] / "checkpoints" / "epoch-000006"
    assert {".metadata", "ddpkit.pt", *(f"__{r}_0.distcp" for r in range(4))} <= {p.name for p in ckpt.iterdir()}
    assert torch.load(ckpt / "ddpkit.pt", weights_only=True)["world_size"] == 4


@pytest.mark.slow
def test_checkpoints_cross_between_hsdp_fsdp_and_ddp_across_world_sizes(runs, tmp_path):
    final = load_model(runs["ddp"])
    hsdp_ckpts = runs["hsdp"] / "checkpoints"
    # HSDP's 2-D sharded checkpoint of 4 ranks, resharded over 2 by FSDP (1-D) ...
    to_fsdp = _resume(hsdp_ckpts / "epoch-000002", tmp_path / "fsdp", "--strategy", "fsdp", "--nproc", "2")
    assert_state_close(to_fsdp, final, **CLOSE)
    # ... whose own checkpoint (2 ranks) goes back to HSDP on 4, now with activation checkpointing
    back = _resume(
        tmp_path / "fsdp" / "checkpoints" / "epoch-000004", tmp_path / "back", *HSDP, "--activation-checkpointing"
    )
    assert_state_close(back, final, **CLOSE)
    assert json.loads((tmp_path / "back" / "summary.json").read_text())["activation_checkpointing"] is True
    # read whole by DDP on 2 ranks
    to_ddp = _resume(hsdp_ckpts / "epoch-000004", tmp_path / "ddp", "--strategy", "ddp", "--nproc", "2")
    assert_state_close(to_ddp, final, **CLOSE)
    # DDP's one-file checkpoint, sharded on load over the 2-D mesh
    from_ddp = _resume(runs["ddp"] / "checkpoints" / "epoch-000002.pt", tmp_path / "from-ddp", *HSDP)
    assert_state_close(from_ddp, final, **CLOSE)
    # HSDP is FSDP with replicas: --strategy fsdp --replicate 2 continues HSDP's checkpoint on the same 2 x 2 mesh
    as_fsdp = [*HSDP[:1], "fsdp", *HSDP[2:]]
    replicated = _resume(hsdp_ckpts / "epoch-000004", tmp_path / "fsdp-replicated", *as_fsdp)
    assert_state_close(replicated, final, **CLOSE)
    out = (tmp_path / "fsdp-replicated" / "out.txt").read_text()
    assert "--strategy fsdp --replicate 2: 2 replicas x 2 shards (HSDP" in out, out
