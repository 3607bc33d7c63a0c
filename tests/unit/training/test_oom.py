"""Out of memory (training/oom.py): which errors are one, the allocation read from the allocator's
message, the phase read from the traceback (a real step on one process), the settings to try with
their exact values, and the few lines the launcher prints."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ddpkit import DistEnv
from ddpkit.launchers.report import job_failure, out_of_memory
from ddpkit.runtime import Runtime
from ddpkit.strategies import DdpStrategy
from ddpkit.training.oom import (
    OomAdvice,
    OutOfMemory,
    oom_error,
    phase_of,
    settings_to_try,
    smaller_micro_batch,
    tried_bytes,
)
from ddpkit.training.step import StepRunner
from ddpkit.util.envvars import attempt_errors

CPU = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 27000832 bytes. Error code 12 (Cannot allocate memory)"
)
CPU_OLD = (
    "[enforce fail at CPUAllocator.cpp:64] . DefaultCPUAllocator: not enough memory: you tried to allocate 1024 bytes."
)
CUDA = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which "
    "1.21 GiB is free. Of the allocated memory 75.00 GiB is allocated by PyTorch"
)


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError(CUDA),
        MemoryError(),
        RuntimeError(CPU),
        RuntimeError(CPU_OLD),
        RuntimeError("std::bad_alloc"),
        RuntimeError("[../third_party/gloo/gloo/transport/tcp/buffer.cc:42] Cannot allocate memory"),
        OSError(12, "Cannot allocate memory"),
    ],
    ids=["cuda", "memory-error", "cpu", "cpu-older-torch", "bad-alloc", "enomem", "oserror-enomem"],
)
def test_out_of_memory_errors_are_told_apart(error: BaseException) -> None:
    assert oom_error(error) is error
    try:  # also as the cause or context of another error (a checkpoint writer's DdpkitError, a wrapper)
        try:
            raise error
        except BaseException as inner:
            raise ValueError("writing the checkpoint failed") from inner
    except ValueError as outer:
        assert oom_error(outer) is error


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("Connection closed by peer [127.0.0.1]:29500"),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 2x2)"),
        ValueError("you tried to allocate 12 bytes"),  # only a RuntimeError carries the allocator's words
        OSError(28, "No space left on device"),
    ],
)
def test_other_errors_are_not_out_of_memory(error: BaseException) -> None:
    assert oom_error(error) is None


def test_the_allocation_is_read_from_the_allocators_message() -> None:
    assert tried_bytes(CPU) == 27000832
    assert tried_bytes(CPU_OLD) == 1024
    assert tried_bytes(CUDA) == 2 * 2**30
    assert (
        tried_bytes("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity)") == 20 * 2**20
    )
    assert tried_bytes("std::bad_alloc") is None


def _frames(*inner: tuple[str, str]) -> list[tuple[str, str]]:
    outer = [
        ("/x/site-packages/ddpkit/worker.py", "train_worker"),
        ("/x/site-packages/ddpkit/training/loop.py", "fit"),
        ("/x/site-packages/ddpkit/training/cadence.py", "moments"),
    ]
    return outer + list(inner)


def test_the_phase_is_read_from_the_traceback() -> None:
    step = ("/x/site-packages/ddpkit/training/epoch.py", "train"), ("/x/ddpkit/training/step.py", "run")
    assert phase_of(_frames(*step, ("/x/ddpkit/training/step.py", "_forward"), ("/x/gpt.py", "forward"))) == "forward"
    assert phase_of(_frames(*step, ("/x/ddpkit/training/step.py", "_backward"))) == "backward"
    assert phase_of(_frames(*step, ("/x/ddpkit/training/step.py", "_optimizer_step"))) == "optimizer step"
    assert phase_of(_frames(*step)) == "step (loading the batch)"
    fsdp_gather = ("/x/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "foreach_all_gather")
    assert phase_of(_frames(*step, ("/x/ddpkit/training/step.py", "_forward"), fsdp_gather)) == (
        "forward (FSDP all-gather)"
    )
    reduce = ("/x/torch/distributed/distributed_c10d.py", "all_reduce")
    assert phase_of(_frames(*step, ("/x/ddpkit/training/step.py", "_backward"), reduce)) == "backward (all-reduce)"
    assert phase_of(
        _frames(("/x/ddpkit/training/loop.py", "evaluate"), ("/x/ddpkit/training/evaluate.py", "evaluate"))
    ) == ("evaluate")
    assert phase_of(_frames(("/x/ddpkit/training/loop.py", "evaluate"))) == "evaluate"
    save = ("/x/ddpkit/checkpoint/checkpointer.py", "save"), ("/x/ddpkit/checkpoint/file.py", "atomic_save")
    assert phase_of(_frames(*save)) == "save (checkpoint)"
    assert phase_of(_frames(("/x/ddpkit/training/loop.py", "__init__"))) == "setup"
    assert phase_of(_frames(("/x/ddpkit/training/loop.py", "__init__"), ("/x/ddpkit/training/loop.py", "resume"))) == (
        "resume (loading the checkpoint)"
    )
    assert phase_of([("/x/ddpkit/worker.py", "_build_task"), ("/x/gpt.py", "build")]) == "setup (building the task)"
    assert phase_of([("/x/somewhere.py", "f")]) == "training"


def test_the_settings_to_try_keep_the_global_batch_with_exact_values() -> None:
    assert smaller_micro_batch(32, 1, False, 2) == "--batch-size 16 --accumulate 2"
    assert smaller_micro_batch(9, 2, False, 2) == "--batch-size 3 --accumulate 6"
    assert smaller_micro_batch(13, 1, False, 4) == "--batch-size 7 --global-batch-size 52"  # a prime: fixed
    assert smaller_micro_batch(32, 1, True, 2) == "--batch-size 16"  # --global-batch-size given: it stays
    assert smaller_micro_batch(1, 4, False, 2) is None
    tries = settings_to_try(32, 1, False, 2, "ddp", False)
    assert [t.split(" (")[0] for t in tries] == [
        "--batch-size 16 --accumulate 2",
        "--activation-checkpointing",
        "--strategy fsdp",
    ]
    assert settings_to_try(1, 1, False, 4, "fsdp", True) == []  # nothing left to cut
    assert settings_to_try(1, 1, False, 4, "fsdp", False, blocks=False) == []  # no block to checkpoint
    assert [t.split(" (")[0] for t in settings_to_try(8, 1, False, 1, "ddp", True)] == ["--batch-size 4 --accumulate 2"]


def _advice(**kw) -> OomAdvice:
    base = dict(
        rank=1,
        world_size=2,
        nproc=2,
        nnodes=1,
        task="examples/gpt.py:build",
        task_args={"n_embd": 128, "name": "a b"},
        batch_size=64,
        accumulate=1,
        fixed=False,
        strategy="ddp",
        checkpointing=False,
        run_dir=Path("runs/x"),
    )
    return OomAdvice(**{**base, **kw})


def test_the_message_says_where_how_much_what_the_rank_holds_and_what_to_try() -> None:
    advice = _advice(state={"params": 2**20, "grads": 2**20, "optimizer": 2**21, "total": 2**22})
    advice.steps_done = lambda: 6
    text = advice.message(CPU, "backward")
    lines = text.splitlines()
    assert lines[0] == (
        "rank 1 ran out of memory in backward at step 7: it tried to allocate 25.8 MiB; its model state is "
        "4.0 MiB per rank (ddp: params 1.0 MiB, grads 1.0 MiB, optimizer 2.0 MiB)"
    )
    assert "    --batch-size 32 --accumulate 2 (the same global batch in smaller micro-batches)" in lines
    assert lines[-1] == (
        "  see the memory plan: ddpkit plan examples/gpt.py:build --task-arg n_embd=128 --task-arg 'name=a b' "
        "--nproc 2 --batch-size 64"
    )
    assert len(lines) < 10 and "plan said" not in text
    assert _advice(strategy="fsdp", precision="bf16", checkpointing=True, nnodes=2).plan_command() == (
        "ddpkit plan examples/gpt.py:build --task-arg n_embd=128 --task-arg 'name=a b' --nproc 2 --nnodes 2 "
        "--batch-size 64 --strategy fsdp --precision bf16 --activation-checkpointing"
    )
    advice.note_plan("DDP needs 9.0 GiB per rank of 8.0 GiB: fsdp fits")
    assert "  the plan said: DDP needs 9.0 GiB per rank of 8.0 GiB: fsdp fits" in advice.message(CPU, "forward")
    assert advice.message(CPU, "save (checkpoint)").startswith(
        "rank 1 ran out of memory in save (checkpoint) after step 6"
    )
    assert advice.message("std::bad_alloc", "setup").startswith("rank 1 ran out of memory in setup (std::bad_alloc)")
    assert advice.message(CUDA, "forward").startswith(
        "rank 1 ran out of memory in forward at step 7: it tried to allocate 2.0 GiB (the GPU had 1.21 GiB free of "
        "79.10 GiB); its model state is 4.0 MiB per rank"
    )


def test_no_memory_summary_file_on_a_cpu(tmp_path: Path) -> None:
    advice = _advice(run_dir=tmp_path)
    assert advice.save_summary() is None
    assert list(tmp_path.iterdir()) == []


class _Allocating(nn.Module):
    """A linear layer that runs out of memory where the test says: forward, backward or never."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where, self.lin = where, nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.where == "forward":
            raise RuntimeError(CPU)
        out = self.lin(x)
        return _RaisesInBackward.apply(out) if self.where == "backward" else out


class _RaisesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(CPU)


class _RaisingSGD(torch.optim.SGD):
    def step(self, closure=None):
        raise torch.OutOfMemoryError(CUDA)


@pytest.mark.parametrize("where", ["forward", "backward", "optimizer step"])
def test_a_real_step_names_its_phase_and_the_global_step(where: str) -> None:
    model = _Allocating(where)
    opt = (_RaisingSGD if where == "optimizer step" else torch.optim.SGD)(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    with Runtime(DistEnv(), device="cpu", threads=1) as rt:
        runner = StepRunner(rt, DdpStrategy(rt), model, opt, nn.CrossEntropyLoss())
        advice = _advice(rank=0, world_size=1, nproc=1, task_args={})
        advice.steps_done = lambda: 41
        with pytest.raises(OutOfMemory) as caught, advice.watching():
            runner.run((x, y), 4, 4, "epoch 1, step 42")
    head = str(caught.value).splitlines()[0]
    tried = "2.0 GiB (the GPU had 1.21 GiB free of 79.10 GiB)" if where == "optimizer step" else "25.8 MiB"
    assert head == f"rank 0 ran out of memory in {where} at step 42: it tried to allocate {tried}"
    assert caught.value.exit_code == 1 and caught.value.__suppress_context__


class _Failed:
    def __init__(self, rank: int) -> None:
        self.failures = {rank: SimpleNamespace(exitcode=1, timestamp=100)}
        self.rank = rank

    def get_first_failure(self):
        return self.rank, self.failures[self.rank]


def test_the_launcher_prints_the_first_ranks_lines_and_names_the_others(tmp_path: Path) -> None:
    folder = attempt_errors(tmp_path, 0)
    folder.mkdir(parents=True)
    (folder / "oom-1.txt").write_text("rank 1 ran out of memory in forward at step 3: ...\n  settings ...")
    (folder / "oom-3.txt").write_text("rank 3 ran out of memory in forward at step 3: ...")
    (folder / "peer-0.txt").write_text("rank 0 lost contact with another rank")
    assert out_of_memory(folder, 3).splitlines()[:2] == [
        "rank 3 ran out of memory in forward at step 3: ...",
        "  rank(s) 1 ran out of memory too",
    ]
    assert out_of_memory(folder, 0).splitlines() == [
        "rank 1 ran out of memory in forward at step 3: ...",
        "  rank(s) 3 ran out of memory too",
        "  settings ...",
    ]
    error = job_failure(_Failed(0), tmp_path, 0, None, 0.0)
    assert str(error).startswith("rank 1 ran out of memory") and error.exit_code == 1
    assert out_of_memory(attempt_errors(tmp_path, 1)) is None


def test_an_out_of_memory_in_a_save_leaves_the_last_checkpoint_as_it_was(tmp_path: Path, monkeypatch) -> None:
    """atomic_save writes beside the file and renames: a save that runs out of memory leaves no
    partial file, the previous checkpoint loads, and the message says --resume continues from it."""
    from ddpkit.checkpoint import file as ckpt_file

    folder = tmp_path / ckpt_file.CKPT_DIR
    ckpt_file.save_or_explain({"step": 1}, folder / "epoch-000000-step-000001.pt")

    def oom(*args, **kwargs):
        raise RuntimeError(CPU)

    monkeypatch.setattr(torch, "save", oom)
    advice = _advice(run_dir=tmp_path)
    with pytest.raises(OutOfMemory) as caught, advice.watching():
        ckpt_file.save_or_explain({"step": 2}, folder / "epoch-000000-step-000002.pt")
    monkeypatch.undo()
    assert [p.name for p in folder.iterdir()] == ["epoch-000000-step-000001.pt"]
    assert torch.load(folder / "epoch-000000-step-000001.pt", weights_only=True) == {"step": 1}
    assert str(caught.value).splitlines()[-1] == f"  --resume continues from the last checkpoint in {folder}"


def test_activation_checkpointing_is_suggested_only_where_it_finds_blocks() -> None:
    from ddpkit.strategies.activation import has_blocks

    assert has_blocks(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)))
    assert not has_blocks(nn.Linear(3, 2))
    assert not has_blocks(nn.Linear(3, 2), blocks=lambda model: 1 / 0)  # a task's hook that fails


def test_the_always_call_hooks_failing_after_it_add_no_warning() -> None:
    """FSDP's post-forward hook (always_call) fails after an error in the forward; torch warns of
    each such hook in two lines, which a deep model multiplies: the error itself is what is said."""
    model = _Allocating("forward")

    def fails(module, args, output):
        raise RuntimeError("post-forward of a forward that never finished")

    model.register_forward_hook(fails, always_call=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(OutOfMemory), _advice().watching():
            model(torch.randn(2, 3))
        warnings.warn("another warning still shows", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["another warning still shows"]


def test_on_a_gpu_the_allocators_summary_is_saved_and_named(tmp_path: Path, monkeypatch) -> None:
    """The CUDA path without a GPU: torch's memory_summary stands in (the real one needs a device)."""
    monkeypatch.setattr(torch.cuda, "memory_summary", lambda *a, **k: "|  PyTorch CUDA memory summary  |")
    advice = _advice(run_dir=tmp_path, device_type="cuda")
    try:
        raise torch.OutOfMemoryError(CUDA)
    except torch.OutOfMemoryError as e:
        error = advice.error(e)
    summary = tmp_path / "oom-rank-1.txt"
    assert summary.read_text() == "|  PyTorch CUDA memory summary  |\n"
    assert f"  the allocator's memory summary is in {summary}" in str(error).splitlines()
