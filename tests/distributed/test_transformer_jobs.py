"""The jobs people really run, through the real CLI: the GPT example (dict batches, the
model's own loss, a Task.scheduler, clipping) and a Hugging Face GPT2LMHeadModel on padded
batches. The same global batch gives the same model.pt at any world size, with or without
--accumulate, under DDP and FSDP; resumed runs are bit-identical; the plain HF path
trains on the model's own .loss; bad inputs are one line and exit 2.

The models are tiny (2 blocks, width 32, 56 training windows), so each run takes seconds."""

import ast
import importlib.util
import json
import shutil
import sys

import pytest
import torch

from conftest import REPO, assert_state_close, assert_state_equal, load_model, run_ddpkit

GPT = str(REPO / "examples" / "gpt.py") + ":build"
HF_PLAIN = str(REPO / "examples" / "hf_transformers.py") + ":build"
HF_EXACT = str(REPO / "examples" / "hf_transformers.py") + ":build_exact"
# 56 training samples, global batch 16: 3 full steps and a short one of 8 per epoch
TINY = [
    "--task-arg",
    "n_layer=2",
    "--task-arg",
    "n_head=2",
    "--task-arg",
    "n_embd=32",
    "--task-arg",
    "dropout=0.0",
    "--task-arg",
    "max_samples=56",
]
GPT_TINY = TINY + ["--task-arg", "block_size=32", "--task-arg", "warmup_steps=3"]
HF_TINY = TINY + ["--task-arg", "max_length=32"]
COMMON = ["--epochs", "2", "--seed", "7", "--clip-grad-norm", "1.0", "--threads", "1", "--quiet"]
B = 8  # per process at 2 processes
# name: (processes, batch per process, accumulate, strategy): the same global batch of 2B
LAYOUTS = {
    "1x16": (1, 2 * B, 1, "ddp"),
    "2x8": (2, B, 1, "ddp"),
    "2x4x2": (2, B // 2, 2, "ddp"),
    "fsdp-2x8": (2, B, 1, "fsdp"),
}


RESUMED = {"2x8": "epoch-000001.pt", "fsdp-2x8": "epoch-000001"}  # layout: its checkpoint after epoch 1


def _train(task, run_dir, layout, *extra):
    nproc, batch, accumulate, strategy = LAYOUTS[layout]
    return run_ddpkit(
        "train",
        task,
        "--nproc",
        str(nproc),
        "--batch-size",
        str(batch),
        "--accumulate",
        str(accumulate),
        "--strategy",
        strategy,
        "--run-dir",
        str(run_dir),
        *COMMON,
        *extra,
    )


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _summary(run):
    return json.loads((run / "summary.json").read_text())


def _example(name):
    """examples/NAME.py as a module (registered, so that its dataclasses resolve)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", REPO / "examples" / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpt_runs(tmp_path_factory):
    """The GPT example in every layout; the 2-process ones also checkpoint every epoch (for the resume test)."""
    root = tmp_path_factory.mktemp("gpt")
    for layout in LAYOUTS:
        _train(GPT, root / layout, layout, *GPT_TINY, "--save-every", "1" if layout in RESUMED else "0")
    return root


@pytest.fixture(scope="module")
def hf_exact_runs(tmp_path_factory):
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    root = tmp_path_factory.mktemp("hf")
    for layout in LAYOUTS:
        _train(HF_EXACT, root / layout, layout, *HF_TINY, "--save-every", "0")
    return root


@pytest.mark.parametrize("runs", ["gpt_runs", "hf_exact_runs"])
def test_same_global_batch_same_model_at_any_world_size_accumulation_and_strategy(runs, request):
    root = request.getfixturevalue(runs)
    # within 1e-5: the attention's key bias has a gradient of pure rounding noise (softmax ignores a
    # shift shared by all keys), which Adam's normalisation turns into steps of ~1e-6
    one = load_model(root / "1x16")
    for layout in ("2x8", "2x4x2"):
        assert_state_close(load_model(root / layout), one, rtol=1e-5, atol=1e-5)
    assert_state_close(load_model(root / "fsdp-2x8"), load_model(root / "2x8"), rtol=1e-5, atol=1e-5)
    for layout in LAYOUTS:
        rows = _metrics(root / layout)
        assert [r["epoch"] for r in rows] == [1, 2]
        assert rows[-1]["train_loss"] < rows[0]["train_loss"], (layout, rows)
        assert 0 < rows[-1]["eval_loss"] < 4.6, (layout, rows)  # below a uniform guess over ~100 characters (ln 104)
        assert rows[0]["train_loss"] == pytest.approx(_metrics(root / "1x16")[0]["train_loss"], rel=1e-5)
        assert rows[-1]["eval_loss"] == pytest.approx(_metrics(root / "1x16")[-1]["eval_loss"], rel=1e-5)
    s = _summary(root / "2x4x2")
    assert s["global_batch"] == 16 and s["accumulate"] == 2 and _summary(root / "fsdp-2x8")["strategy"] == "fsdp"


def test_gpt_scheduler_warms_up_then_decays(gpt_runs):
    # warm-up over 3 steps to 3e-3, then a cosine to 3e-4 at the run's 8 optimizer steps
    lrs = [r["lr"] for r in _metrics(gpt_runs / "2x8")]
    assert lrs[0] > lrs[1] > 0, lrs
    assert lrs[-1] == pytest.approx(3e-4, rel=1e-3), lrs


@pytest.mark.parametrize("layout", RESUMED)
def test_gpt_resume_with_scheduler_and_clipping_is_bit_identical(gpt_runs, tmp_path, layout):
    split = tmp_path / "split"
    (split / "checkpoints").mkdir(parents=True)  # the run as it was after epoch 1 (a file, or FSDP's sharded directory)
    src = gpt_runs / layout / "checkpoints" / RESUMED[layout]
    (shutil.copytree if src.is_dir() else shutil.copy)(src, split / "checkpoints" / src.name)
    _train(GPT, split, layout, *GPT_TINY, "--save-every", "1", "--resume")
    assert_state_equal(load_model(split), load_model(gpt_runs / layout))
    keep = ("epoch", "train_loss", "eval_loss", "lr")  # epoch 2 only: the lr went on from the restored schedule
    assert [{k: r[k] for k in keep} for r in _metrics(split)] == [
        {k: r[k] for k in keep} for r in _metrics(gpt_runs / layout)[1:]
    ]


def _resume(src, run, layout, *flags):
    """Train `layout` on from checkpoint `src` (after epoch 1) into `run`."""
    (run / "checkpoints").mkdir(parents=True)
    (shutil.copytree if src.is_dir() else shutil.copy)(src, run / "checkpoints" / src.name)
    _train(GPT, run, layout, *GPT_TINY, "--save-every", "0", "--resume", *flags)


@pytest.mark.slow  # three runs of 2 processes
def test_activation_checkpointing_same_model_checkpoints_cross_and_the_plan_counts_what_ranks_keep(gpt_runs, tmp_path):
    import ddpkit

    ac = tmp_path / "fsdp-ac"
    _train(GPT, ac, "fsdp-2x8", *GPT_TINY, "--save-every", "1", "--activation-checkpointing")
    assert_state_equal(load_model(ac), load_model(gpt_runs / "fsdp-2x8"))  # the same arithmetic, recomputed
    # its checkpoint resumes without it, and DDP's checkpoint written without it resumes with it
    _resume(ac / "checkpoints" / "epoch-000001", tmp_path / "without", "fsdp-2x8")
    assert_state_equal(load_model(tmp_path / "without"), load_model(gpt_runs / "fsdp-2x8"))
    _resume(
        gpt_runs / "2x8" / "checkpoints" / "epoch-000001.pt", tmp_path / "with", "2x8", "--activation-checkpointing"
    )
    assert_state_equal(load_model(tmp_path / "with"), load_model(gpt_runs / "2x8"))
    # the plan's estimate (one forward of the first samples, at 1 and 2, extrapolated to the batch)
    # is what each rank's first forward kept, with checkpointing and without, under DDP and FSDP
    task_args = {k: ast.literal_eval(v) for k, v in (a.split("=") for a in GPT_TINY[1::2])}
    plan = ddpkit.memory_plan(GPT, nproc=2, batch_size=B, task_args=task_args, activation_checkpointing=True)
    a = plan.activations
    for layout in ("2x8", "fsdp-2x8"):
        assert _summary(gpt_runs / layout)["activation_bytes_per_rank"] == a.kept
    assert _summary(ac)["activation_bytes_per_rank"] == a.kept_checkpointed < a.kept / 2
    assert _summary(ac)["activation_checkpointing"] and not _summary(gpt_runs / "fsdp-2x8")["activation_checkpointing"]
    assert _summary(gpt_runs / "1x16")["activation_bytes_per_rank"] == pytest.approx(2 * a.kept, rel=0.01)


def test_gpt_model_pt_loads_into_the_example_model_and_generates(gpt_runs):
    gpt = _example("gpt")
    _, _, vocab = gpt.char_data(32, 8)
    model = gpt.GPT(gpt.GPTConfig(len(vocab), block_size=32, n_layer=2, n_head=2, n_embd=32))
    for run in ("2x8", "fsdp-2x8"):
        model.load_state_dict(load_model(gpt_runs / run))
        assert model.head.weight.data_ptr() == model.wte.weight.data_ptr()  # still tied after loading
    out = model.generate(vocab.encode("def ")[None], 10)
    assert out.shape == (1, 14)


def test_hf_model_trains_on_its_own_loss_and_model_pt_loads_into_a_fresh_gpt2(tmp_path):
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    run = tmp_path / "plain"
    proc = run_ddpkit(
        "train",
        HF_PLAIN,
        "--nproc",
        "2",
        "--batch-size",
        str(B),
        "--epochs",
        "3",
        "--seed",
        "7",
        "--run-dir",
        str(run),
        "--save-every",
        "0",
        "--threads",
        "1",
        "--peak-tflops",
        "0.5",
        *HF_TINY,
    )
    rows = _metrics(run)
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] - 0.3, rows
    # HF's mask code cannot run on the meta device: the FLOPs come from its config, so MFU shows
    throughput = json.loads((run / "summary.json").read_text())["throughput"]
    assert throughput["flops_note"].startswith("estimated from the model's config"), throughput
    assert throughput["flops_per_sample"] > 0 and throughput["mfu"] > 0 and throughput["tflops_per_device"] > 0
    assert "MFU" in proc.stdout
    assert rows[-1]["eval_loss"] < 4.0, rows
    assert "eval loss" in proc.stdout
    hf = _example("hf_transformers")
    train_set, _, chars = hf.doc_data(32, 56)
    model = hf.gpt2_model(len(chars) + 1, 32, n_layer=2, n_head=2, n_embd=32)
    model.load_state_dict(load_model(run))
    model.eval()
    batch = train_set[0:4]
    with torch.no_grad():
        loss = model(**batch).loss.item()
    assert loss < 4.0  # a trained model, not the random init (~4.65)


BAD_TASKS = """
import sys
sys.path.insert(0, EXAMPLES)
import gpt

SCHEDULERS = {
    "not_callable": 42,
    "returns_text": lambda optimizer: "cosine",
    "returns_the_optimizer": lambda optimizer: optimizer,  # has step() and state_dict() too, but is no scheduler
}

def build(config=None, kind="not_callable"):
    task = gpt.build(config, n_layer=1, n_embd=16, n_head=2, block_size=16, max_samples=16)
    task.scheduler = SCHEDULERS[kind]
    return task
"""


@pytest.mark.parametrize(
    "args, fragment",
    [
        ([GPT, "--task-arg", "nope=1"], "nope"),
        ([GPT, "--clip-grad-norm", "0"], "--clip-grad-norm"),
        (["bad.py:build"], "scheduler"),
        (["bad.py:build", "--task-arg", "kind=returns_text"], "scheduler"),
        (["bad.py:build", "--task-arg", "kind=returns_the_optimizer"], "scheduler"),
        ([GPT, "--precision", "fp16"], "fp16"),
    ],
)
def test_bad_inputs_are_one_line_and_exit_2(tmp_path, args, fragment):
    (tmp_path / "bad.py").write_text(BAD_TASKS.replace("EXAMPLES", repr(str(REPO / "examples"))))
    proc = run_ddpkit(
        "train",
        *args,
        "--nproc",
        "1",
        "--epochs",
        "1",
        "--threads",
        "1",
        "--timeout",
        "30",
        cwd=tmp_path,
        check=False,
        timeout=90,
    )
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpkit: error: ") and fragment in lines[0], proc.stderr
    assert not list(tmp_path.rglob("model.pt"))
