"""--strategy fsdp end to end through the real CLI (gloo on CPU): FSDP trains to DDP's
parameters, its sharded checkpoints resume bit-identically, reshard from 4 ranks to 2, cross
to and from DDP's one-file checkpoints, and the memory plan matches what the ranks hold."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import REPO, assert_state_close, assert_state_equal, load_model, run_ddpkit
from ddpkit.strategies.precision import cpu_has_bf16
from ddpkit.tasks.wine import wine_model

DEEP = str(REPO / "examples" / "deep_mlp.py") + ":build"
WINE = ["--epochs", "6", "--seed", "5", "--save-every", "2", "--quiet"]
DEEP_ARGS = ["--epochs", "3", "--seed", "3", "--batch-size", "24", "--save-every", "0", "--quiet"]
NATIVE_BF16 = cpu_has_bf16()  # what ddpkit itself asks before it accepts --precision bf16 on a CPU
# Where the CPU lacks it, --precision bf16 is refused (test_bf16_without_native_support_is_refused):
# this CPU then checks the refusal for real instead of the training.
needs_native_bf16 = pytest.mark.skipif(
    not NATIVE_BF16,
    reason="needs a CPU with native bfloat16 (AVX512-BF16 or AMX); this one has neither, "
    "so ddpkit refuses --precision bf16 here (checked by test_bf16_without_native_support_is_refused)",
)


def _summary(run):
    return json.loads((run / "summary.json").read_text())


@pytest.fixture(scope="module")
def wine_runs(tmp_path_factory, reference_run):
    """The same Wine job, uninterrupted, under DDP (the default strategy; test_train's resume
    test compares with the same run) and under FSDP (2 processes each): {strategy: run dir}."""
    fsdp = tmp_path_factory.mktemp("wine") / "fsdp"
    run_ddpkit("train", "--strategy", "fsdp", "--nproc", "2", "--run-dir", str(fsdp), *WINE)
    return {
        "ddp": reference_run("--nproc", "2", "--seed", "5", "--save-every", "2", "--epochs", "6", "--quiet"),
        "fsdp": fsdp,
    }


@pytest.fixture(scope="module")
def deep_runs(tmp_path_factory):
    """A 6-block residual MLP (ModuleList: one FSDP unit per block) under DDP and under FSDP
    (--strategy auto against the memory plan: tests/distributed/test_memory_plan.py)."""
    root = tmp_path_factory.mktemp("deep")
    run_ddpkit("train", DEEP, "--strategy", "ddp", "--nproc", "2", "--run-dir", str(root / "ddp"), *DEEP_ARGS)
    fsdp = ["--strategy", "fsdp", "--nproc", "2", "--run-dir", str(root / "fsdp"), *DEEP_ARGS[:-1]]  # not quiet
    proc = run_ddpkit("train", DEEP, *fsdp)
    (root / "fsdp.out").write_text(proc.stdout)
    return root


def test_fsdp_trains_wine_to_ddps_parameters_and_keeps_the_run_contract(wine_runs):
    ddp, fsdp = wine_runs["ddp"], wine_runs["fsdp"]
    assert_state_close(load_model(fsdp), load_model(ddp), rtol=1e-5, atol=1e-6)
    model = wine_model()
    model.load_state_dict(load_model(fsdp))  # model.pt: a plain consolidated state_dict
    assert not all(torch.equal(v, wine_model().state_dict()[k]) for k, v in model.state_dict().items())
    s = _summary(fsdp)
    assert s["strategy"] == "fsdp" and s["precision"] == "fp32" and len(s["peak_memory_bytes"]) == 2
    assert s["eval_accuracy"] == pytest.approx(_summary(ddp)["eval_accuracy"])
    # sharded checkpoints: one directory per save, one shard file per rank
    ckpts = wine_runs["fsdp"] / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch-000002", "epoch-000004", "epoch-000006"]
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "ddpkit.pt"} <= {
        p.name for p in (ckpts / "epoch-000006").iterdir()
    }
    meta = torch.load(ckpts / "epoch-000006" / "ddpkit.pt", weights_only=True)
    assert meta["epoch"] == 6 and meta["world_size"] == 2 and len(meta["rng"]) == 2


def test_fsdp_resume_is_bit_identical_and_skips_incomplete_checkpoints(wine_runs, tmp_path):
    split = tmp_path / "split"
    (split / "checkpoints").mkdir(parents=True)  # the run as it was after epoch 2 ...
    shutil.copytree(wine_runs["fsdp"] / "checkpoints" / "epoch-000002", split / "checkpoints" / "epoch-000002")
    # ... and what a crash leaves: a save that never got renamed, and a directory without one of its shards
    (split / "checkpoints" / ".epoch-000004.partial").mkdir()
    (split / "checkpoints" / ".epoch-000004.partial" / "__0_0.distcp").write_bytes(b"half")
    shutil.copytree(split / "checkpoints" / "epoch-000002", split / "checkpoints" / "epoch-000005")
    (split / "checkpoints" / "epoch-000005" / "__1_0.distcp").unlink()
    proc = run_ddpkit("train", "--strategy", "fsdp", "--nproc", "2", "--resume", "--run-dir", str(split), *WINE[:-1])
    assert "skipping checkpoint" in proc.stdout and "epoch-000005/__1_0.distcp: missing" in proc.stdout
    assert "resuming from" in proc.stdout and "epoch-000002 (epoch 2 done)" in proc.stdout
    assert sorted(p.name for p in (split / "checkpoints").iterdir()) == [
        "epoch-000002",
        "epoch-000004",
        "epoch-000005",
        "epoch-000006",
    ]
    assert_state_equal(load_model(split), load_model(wine_runs["fsdp"]))
    keep = ("epoch", "train_loss", "eval_loss")
    rows = lambda run: [  # noqa: E731
        {k: r[k] for k in keep} for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    ]
    assert rows(split) == rows(wine_runs["fsdp"])[2:]


def test_save_on_4_ranks_resume_on_2(wine_runs, tmp_path):
    run = tmp_path / "run"
    # 4 x 16 and 2 x 32: the same global batch, so the same steps (ddpkit's global order)
    run_ddpkit(
        "train",
        "--strategy",
        "fsdp",
        "--nproc",
        "4",
        "--batch-size",
        "16",
        "--epochs",
        "3",
        "--seed",
        "5",
        "--save-every",
        "3",
        "--quiet",
        "--run-dir",
        str(run),
    )
    shards = {p.name for p in (run / "checkpoints" / "epoch-000003").iterdir()}
    assert {f"__{r}_0.distcp" for r in range(4)} <= shards
    proc = run_ddpkit("train", "--strategy", "fsdp", "--nproc", "2", "--resume", "--run-dir", str(run), *WINE)
    assert proc.returncode == 0
    assert_state_close(load_model(run), load_model(wine_runs["fsdp"]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "saved, source, resumed",
    [
        ("ddp", "epoch-000002.pt", "fsdp"),  # DDP's one-file checkpoint, sharded on load
        ("fsdp", "epoch-000004", "ddp"),  # FSDP's sharded checkpoint, read whole by DDP
    ],
)
def test_checkpoints_cross_between_ddp_and_fsdp(wine_runs, tmp_path, saved, source, resumed):
    run = tmp_path / "run"
    src = wine_runs[saved] / "checkpoints" / source
    (run / "checkpoints").mkdir(parents=True)
    (shutil.copytree if src.is_dir() else shutil.copy)(src, run / "checkpoints" / source)
    proc = run_ddpkit("train", "--strategy", resumed, "--nproc", "2", "--resume", "--run-dir", str(run), *WINE[:-1])
    assert f"resuming from {run / 'checkpoints' / source}" in proc.stdout
    assert_state_close(load_model(run), load_model(wine_runs[resumed]), rtol=1e-5, atol=1e-6)


def test_fsdp_deep_mlp_matches_ddp_and_the_plan_measures_the_sharding(deep_runs):
    import ddpkit

    ddp, fsdp = deep_runs / "ddp", deep_runs / "fsdp"
    assert_state_close(load_model(fsdp), load_model(ddp), rtol=1e-5, atol=1e-6)
    measured_ddp = _summary(ddp)["state_bytes_per_rank"]
    measured_fsdp = _summary(fsdp)["state_bytes_per_rank"]
    ratio = measured_fsdp["total"] / measured_ddp["total"]
    assert ratio == pytest.approx(1 / 2, rel=0.01)  # each rank holds half of params, grads and Adam state
    plan = ddpkit.memory_plan(DEEP, nproc=2)
    assert plan.ddp.state == measured_ddp["total"] and plan.fsdp.state == measured_fsdp["total"]
    assert plan.ddp.optimizer == 2 * plan.ddp.params  # AdamW: two moments, measured by a probe step
    four = ddpkit.memory_plan(DEEP, nproc=4)
    assert four.fsdp.state / four.ddp.state == pytest.approx(1 / 4, rel=0.01)
    for s in (_summary(ddp), _summary(fsdp)):
        assert all(b > 0 for b in s["peak_memory_bytes"]) and s["peak_memory_kind"] == "peak resident set"


def test_the_summary_names_the_strategy_and_the_peak(deep_runs):
    out = (deep_runs / "fsdp.out").read_text()
    assert "strategy     fsdp, fp32" in out and "peak memory" in out and "made of      fixed" in out
    assert _summary(deep_runs / "fsdp")["strategy"] == "fsdp" and _summary(deep_runs / "ddp")["strategy"] == "ddp"


@needs_native_bf16
def test_bf16_trains_under_fsdp_and_ddp_close_to_fp32(deep_runs, tmp_path):
    run_ddpkit(
        "train",
        DEEP,
        "--strategy",
        "fsdp",
        "--precision",
        "bf16",
        "--nproc",
        "2",
        "--run-dir",
        str(tmp_path / "fsdp"),
        *DEEP_ARGS,
    )
    run_ddpkit(
        "train",
        DEEP,
        "--precision",
        "bf16",
        "--nproc",
        "1",
        "--run-dir",
        str(tmp_path / "ddp"),
        *DEEP_ARGS[:4],
        "--batch-size",
        "48",
        "--save-every",
        "0",
        "--quiet",
    )
    fp32 = load_model(deep_runs / "fsdp")
    for name in ("fsdp", "ddp"):
        s = _summary(tmp_path / name)
        assert s["precision"] == "bf16" and s["eval_accuracy"] == pytest.approx(
            _summary(deep_runs / "fsdp")["eval_accuracy"], abs=0.05
        )
        assert_state_close(load_model(tmp_path / name), fp32, rtol=0, atol=0.05)  # bf16 rounding, same training


def test_bad_combinations_are_one_clear_line(tmp_path):
    proc = run_ddpkit(
        "train", "--strategy", "fsdp", "--nproc", "1", "--epochs", "1", cwd=tmp_path, check=False, timeout=60
    )
    assert (
        proc.returncode == 2 and "--strategy fsdp shards the model across processes and needs at least 2" in proc.stderr
    )
    proc = run_ddpkit("plan", "--device-memory", "lots", cwd=tmp_path, check=False, timeout=60)
    assert proc.returncode == 2 and "--device-memory must be a size such as 80GiB" in proc.stderr


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_bf16_without_native_support_is_refused(tmp_path, strategy):
    """On a CPU without AVX512-BF16/AMX the real CLI refuses; on one with them, a child
    process is told the CPU lacks both (what ddpkit asks torch), and must refuse the same way."""
    args = ["train", "--strategy", strategy, "--precision", "bf16", "--nproc", "2", "--epochs", "1", "--run-dir", "r"]
    if NATIVE_BF16:
        no_bf16 = (
            "import sys, torch\n"
            "torch.cpu._is_avx512_bf16_supported = lambda: False\n"  # a CPU without native bfloat16
            "torch.cpu._is_amx_tile_supported = lambda: False\n"
            "from ddpkit.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", no_bf16, *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        )
    else:
        proc = run_ddpkit(*args, cwd=tmp_path, check=False, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "--precision bf16: this CPU has no native bfloat16 (AVX512-BF16 or AMX)" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "r").exists()


def test_plan_command_reports_both_strategies_and_the_pick(tmp_path):
    out = run_ddpkit("plan", DEEP, "--nproc", "4", "--device-memory", "3MB", cwd=tmp_path, timeout=60).stdout
    assert "memory plan:" in out and "4 processes, fp32" in out and "AdamW, 8 bytes of state per parameter" in out
    assert "(FSDP/DDP 0.25)" in out
    assert "DDP no, FSDP no" in out and "--strategy auto  fsdp: nothing fits; the least, FSDP x4" in out
    assert "fixed cost" in out and "end of run" in out
    dry = run_ddpkit("train", DEEP, "--strategy", "fsdp", "--nproc", "4", "--dry-run", cwd=tmp_path, timeout=60).stdout
    assert "launch plan (dry run: nothing started)" in dry and "(FSDP/DDP 0.25)" in dry
    assert "--strategy fsdp  FSDP needs" in dry and not (tmp_path / "runs").exists()


COUNTING = str(REPO / "tests" / "distributed" / "scripts" / "counting_deep_mlp.py") + ":build"


def test_fsdp_accumulation_equals_ddps_and_reduce_scatters_once_per_optimizer_step(tmp_path):
    # 384 samples, global batch 2 x 24 x 2 = 96: 4 optimizer steps per epoch, each of 2 micro-batches
    args = ["--nproc", "2", "--epochs", "2", "--seed", "3", "--save-every", "0", "--quiet"]
    run_ddpkit(
        "train",
        COUNTING,
        "--strategy",
        "fsdp",
        "--batch-size",
        "24",
        "--accumulate",
        "2",
        "--run-dir",
        str(tmp_path / "fsdp-acc"),
        *args,
    )
    run_ddpkit(
        "train",
        COUNTING,
        "--strategy",
        "ddp",
        "--batch-size",
        "24",
        "--accumulate",
        "2",
        "--run-dir",
        str(tmp_path / "ddp-acc"),
        *args,
    )
    run_ddpkit(
        "train", COUNTING, "--strategy", "fsdp", "--batch-size", "48", "--run-dir", str(tmp_path / "fsdp-48"), *args
    )
    assert_state_close(load_model(tmp_path / "fsdp-acc"), load_model(tmp_path / "ddp-acc"), rtol=1e-5, atol=1e-5)
    assert_state_close(load_model(tmp_path / "fsdp-acc"), load_model(tmp_path / "fsdp-48"), rtol=1e-5, atol=1e-5)
    accumulated = json.loads((tmp_path / "fsdp-acc" / "reduce_scatters.json").read_text())
    whole = json.loads((tmp_path / "fsdp-48" / "reduce_scatters.json").read_text())
    ddp = json.loads((tmp_path / "ddp-acc" / "reduce_scatters.json").read_text())
    # the same 8 optimizer steps: as many reduce-scatters as the run without micro-batches
    # (syncing every micro-batch would double them); DDP all-reduces instead
    assert accumulated["epoch"] == whole["epoch"] == 2
    assert accumulated["reduce_scatter"] == whole["reduce_scatter"] > 0, (accumulated, whole)
    assert accumulated["reduce_scatter"] % 8 == 0, accumulated
    assert ddp["reduce_scatter"] == 0, ddp


def test_a_2x2_device_mesh_shards_over_2_keeps_2_replicas_and_trains_to_ddps_parameters(tmp_path):
    """HSDP is FSDP over a 2-D mesh, not another strategy: 4 ranks, float64 SGD with clipping."""
    script = str(REPO / "tests" / "distributed" / "scripts" / "hsdp_parity.py")
    run_ddpkit("launch", "--nproc", "4", script, str(tmp_path / "out.pt"), cwd=tmp_path, timeout=240)
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    assert out["layout"] == {
        "mesh": (2, 2),
        "names": ("replicate", "shard"),
        "placements": ["Replicate", "Shard"],
        "local_rows": 8,
    }  # 16 rows of the first layer: half on each rank of a replica
    assert all(n > 0.05 for n in out["ddp_norms"])  # every step was clipped: the norm over the shards matters
    assert out["hsdp_norms"] == pytest.approx(out["ddp_norms"], rel=1e-6)
    assert_state_close(out["hsdp"], out["ddp"], rtol=1e-6, atol=0)
    assert all((out["hsdp"][k] - out["init"][k]).abs().max() > 1e-3 for k in out["init"])  # it trained


class _RunsCode:
    """Unpickling this would run a command: what a crafted shard item holds."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _craft_a_shard_item(folder, marker):
    """What an attacker who can write the folder makes of a good checkpoint: one non-tensor item of
    a shard (an optimizer setting) replaced by a pickle that runs code, the metadata pointed
    at it and every checksum of the header recomputed: only the item itself tells it apart."""
    import io
    import pickle

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from ddpkit.checkpoint import file as ck
    from ddpkit.checkpoint.dcp_io import load_metadata
    from ddpkit.checkpoint.integrity import crc32_of

    metadata = load_metadata(folder / ".metadata")
    index, info = next(
        (i, s)
        for i, s in metadata.storage_data.items()
        if isinstance(metadata.state_dict_metadata[i.fqn], BytesStorageMetadata)
    )
    payload = io.BytesIO()
    torch.save(_RunsCode(marker), payload)
    shard = folder / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    metadata.storage_data[index] = type(info)(info.relative_path, offset, len(payload.getvalue()))
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    header = torch.load(folder / "ddpkit.pt", weights_only=True)
    header["files"] = {name: crc32_of(folder / name) for name in header["files"]}
    ck.atomic_save(header, folder / "ddpkit.pt")
    return index.fqn


def test_a_shard_item_crafted_to_run_code_is_skipped_at_resume_for_the_previous_checkpoint(wine_runs, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for name in ("epoch-000002", "epoch-000004"):
        shutil.copytree(wine_runs["fsdp"] / "checkpoints" / name, run / "checkpoints" / name)
    fqn = _craft_a_shard_item(run / "checkpoints" / "epoch-000004", tmp_path / "ran")
    proc = run_ddpkit("train", "--strategy", "fsdp", "--nproc", "2", "--resume", "--run-dir", str(run), *WINE[:-1])
    skips = [line for line in proc.stdout.splitlines() if "skipping checkpoint" in line]
    assert len(skips) == 1 and "epoch-000004" in skips[0] and fqn in skips[0] and "not plain data" in skips[0]
    assert f"resuming from {run / 'checkpoints' / 'epoch-000002'} (epoch 2 done)" in proc.stdout
    assert "weights_only" not in proc.stdout + proc.stderr and not (tmp_path / "ran").exists()
    assert_state_equal(load_model(run), load_model(wine_runs["fsdp"]))
