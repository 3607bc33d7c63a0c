"""Out of memory: what a rank says when it runs out, in a few lines instead of a traceback.

A rank that runs out of memory (torch's OutOfMemoryError on a GPU, the CPU allocator's
RuntimeError, Python's MemoryError, a C++ std::bad_alloc) raises OutOfMemory instead, whose
message says which rank, in which phase (read from the traceback: where in the step, or in
evaluation, a save, the setup), at which global step, how much it tried to allocate, what this
rank's model state takes (counted when the run started, not at the failure: the failing rank
cannot be asked to count then) and the settings to try, with their exact values. The worker
hands it to the launcher as the job's one error (worker.py); on a GPU the allocator's summary
goes to RUN_DIR/oom-rank-R.txt.

`OomAdvice.note_plan(line)`: one line of what the memory plan said (e.g. `ddpkit plan`'s
verdict), said with the rest when set; the worker makes the run's OomAdvice (worker._train)
and hands it to fit, which fills in what it learns (the strategy, the state, the step count).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shlex
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from ..checkpoint.file import CKPT_DIR
from ..config.values import format_bytes
from ..errors import WorkerFailed

# what the allocators say (lower case): torch's CPU allocator ("can't allocate memory: you tried to
# allocate N bytes", older "not enough memory"), CUDA's ("CUDA out of memory. Tried to allocate 2.00 GiB"),
# a C++ allocation (std::bad_alloc) and the system's ENOMEM text
OOM_TEXTS = (
    "out of memory",
    "not enough memory",
    "tried to allocate",
    "std::bad_alloc",
    "cannot allocate memory",
    "can't allocate memory",
)
_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9}
SUMMARY_FILE = "oom-rank-{rank}.txt"  # in the run directory: the CUDA allocator's memory summary
ALWAYS_CALL_WARNING = "module forward hook with ``always_call=True`` raised an exception"  # torch's, a regex
OOM_FILE = "oom-{rank}.txt"  # in the attempt's error folder (envvars.error_file): the rank's message, for the launcher

# (a path inside ddpkit, its functions) -> the phase a frame there means; inner frames win
_PHASES = (
    ("worker.py", ("_build_task",), "setup (building the task)"),
    ("training/loop.py", ("__init__",), "setup"),
    ("training/loop.py", ("resume",), "resume (loading the checkpoint)"),
    ("training/loop.py", ("evaluate",), "evaluate"),
    ("training/loop.py", ("finish",), "save (model.pt)"),
    ("checkpoint/checkpointer.py", ("save", "snapshot", "_write_file"), "save (checkpoint)"),
    ("training/epoch.py", ("train",), "step (loading the batch)"),
    ("training/step.py", ("_forward",), "forward"),
    ("training/step.py", ("_backward", "_empty_share_loss"), "backward"),
    ("training/step.py", ("_agreed",), "backward"),
    ("training/step.py", ("_optimizer_step", "_scale_grads"), "optimizer step"),
)
_STEP_PHASES = ("step (loading the batch)", "forward", "backward", "optimizer step")


def oom_error(e: BaseException) -> BaseException | None:
    """The out-of-memory error in `e`'s chain (its causes and contexts), None when there is none."""
    seen: BaseException | None = e
    for _ in range(10):
        if seen is None:
            return None
        if _is_oom(seen):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _is_oom(e: BaseException) -> bool:
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return True
    if isinstance(e, OSError) and e.errno == errno.ENOMEM:  # e.g. a checkpoint's write, a fork
        return True
    if not isinstance(e, RuntimeError):
        return False
    text = str(e).lower()
    return any(t in text for t in OOM_TEXTS)


def tried_bytes(text: str) -> int | None:
    """The allocation that failed, in bytes, as the allocator said it: the CPU's "you tried to
    allocate 27000832 bytes", CUDA's "Tried to allocate 2.00 GiB"; None when it is not said."""
    m = re.search(r"tried to allocate\s+([0-9]*\.?[0-9]+)\s*([kmgt]?i?b)(?:ytes)?\b", text, re.IGNORECASE)
    if not m:
        return None
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def phase_of(frames: list[tuple[str, str]]) -> str:
    """Where the run was, from a traceback's (file, function) frames, outermost first: the phase of
    the innermost ddpkit frame that names one, with the collective running under it when torch's
    frames say so (FSDP's all-gather or reduce-scatter, an all-reduce); "training" otherwise."""
    phase, collective = "training", None
    for filename, function in frames:
        path = filename.replace(os.sep, "/")
        for where, functions, said in _PHASES:
            if path.endswith("ddpkit/" + where) and function in functions:
                phase, collective = said, None
        name = function.lower().replace("_", "")
        if "/torch/distributed/" in path or "ddpkit/runtime/collectives.py" in path or "grad_sync" in path:
            for key, said in (
                ("allgather", "all-gather"),
                ("reducescatter", "reduce-scatter"),
                ("allreduce", "all-reduce"),
            ):
                if key in name:
                    collective = said
    fsdp = any("/fsdp/" in f.replace(os.sep, "/") for f, _ in frames)
    if collective is not None:
        return f"{phase} ({'FSDP ' if fsdp else ''}{collective})"
    return phase


def settings_to_try(
    batch_size: int,
    accumulate: int,
    fixed: bool,
    world_size: int,
    strategy: str,
    checkpointing: bool,
    blocks: bool = True,
) -> list[str]:
    """The settings that need less memory, each with why, most useful first: the same global batch
    in smaller micro-batches, activation checkpointing when off (and the model has `blocks` it
    would find), FSDP when DDP holds the whole state on every one of several ranks."""
    tries = []
    smaller = smaller_micro_batch(batch_size, accumulate, fixed, world_size)
    if smaller is not None:
        tries.append(f"{smaller} (the same global batch in smaller micro-batches)")
    if not checkpointing and blocks:
        tries.append("--activation-checkpointing (recompute each block's activations in backward)")
    if strategy == "ddp" and world_size > 1:
        tries.append(f"--strategy fsdp (shard the model state over the {world_size} processes)")
    return tries


def smaller_micro_batch(batch_size: int, accumulate: int, fixed: bool, world_size: int) -> str | None:
    """The flags that keep the global batch in micro-batches about half the size: "--batch-size 16
    --accumulate 2" (--batch-size cut by its smallest factor up to 7); with --global-batch-size,
    or a --batch-size no such factor divides, the global batch fixed and --batch-size halved (the
    accumulation follows from them). None for a batch of one sample."""
    if batch_size <= 1:
        return None
    factor = next((f for f in range(2, 8) if batch_size % f == 0), None)
    if fixed or factor is None:
        global_batch = "" if fixed else f" --global-batch-size {world_size * batch_size * accumulate}"
        return f"--batch-size {-(-batch_size // 2)}{global_batch}"
    return f"--batch-size {batch_size // factor} --accumulate {accumulate * factor}"


class OutOfMemory(WorkerFailed):
    """A rank ran out of memory: the message is the few lines that say where and what to try
    (exit code 1, a failure of the job, not a usage error)."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


@dataclass
class OomAdvice:
    """What a rank knows, from the start of the run, to say when it runs out of memory.
    `state`: this rank's params, grads and optimizer state in bytes (set once the strategy has
    built them); `steps_done`: how many optimizer steps the run has done (the cadence's count)."""

    rank: int
    world_size: int
    nproc: int  # per node
    nnodes: int
    task: str
    task_args: dict[str, Any]
    batch_size: int
    accumulate: int
    fixed: bool
    strategy: str
    checkpointing: bool
    run_dir: Path
    device_type: str = "cpu"
    precision: str = "fp32"
    blocks: bool = True  # has the model blocks --activation-checkpointing would find (unknown before it is built)
    state: dict[str, int] | None = None
    steps_done: Callable[[], int] | None = None
    plan: str | None = field(default=None)

    @classmethod
    def of(cls, cfg: Any, env: Any, run_dir: Path, device_type: str) -> OomAdvice:
        """From the run's config (RunConfig) and this rank's DistEnv, before anything is built."""
        return cls(
            rank=env.rank,
            world_size=env.world_size,
            nproc=env.local_world_size,
            nnodes=env.nnodes,
            task=cfg.task,
            task_args=dict(cfg.task_args or {}),
            batch_size=cfg.batch_size,
            accumulate=cfg.accumulate,
            fixed=cfg.global_batch_size is not None,
            strategy=cfg.strategy,
            checkpointing=bool(cfg.activation_checkpointing),
            precision=cfg.precision,
            run_dir=Path(run_dir),
            device_type=device_type,
        )

    def note_plan(self, line: str) -> None:
        """One line of what the memory plan said for this run, said with the rest when it runs out."""
        self.plan = line.strip() or None

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Raises OutOfMemory in place of an out-of-memory error raised inside. The forward hooks
        that run whatever happened (always_call: FSDP's post-forward, the activations' count) fail
        after an error in a forward, and torch warns for each, in 2 lines, of an exception it
        silenced: the error that is raised is what the user needs, said once."""
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=ALWAYS_CALL_WARNING, category=UserWarning)
                yield
        except Exception as e:
            oom = oom_error(e)
            if oom is None:
                raise
            raise self.error(e, oom) from None

    def error(self, e: BaseException, oom: BaseException | None = None) -> OutOfMemory:
        """The OutOfMemory to raise for `e` (the error caught, `oom` the out-of-memory one in its
        chain). On a GPU the allocator's summary is taken first, with the frames' tensors still
        held; then the frames' locals are let go: they hold what took the memory."""
        oom = oom or oom_error(e) or e
        saved = self.save_summary()
        frames = [(fs.filename, fs.name) for fs in traceback.extract_tb(e.__traceback__)]
        traceback.clear_frames(e.__traceback__)
        return OutOfMemory(self.message(str(oom), phase_of(frames), saved), self.rank)

    def message(self, text: str, phase: str, summary_file: Path | None = None) -> str:
        """The few lines: what happened, this rank's state, the settings to try, the plan."""
        done = self.steps_done() if self.steps_done is not None else None
        if done is None or phase.startswith(("setup", "resume")):
            at = ""
        elif phase.startswith(_STEP_PHASES):
            at = f" at step {done + 1}"
        else:
            at = f" after step {done}"
        tried = tried_bytes(text)
        head = f"rank {self.rank} ran out of memory in {phase}{at}"
        head += f": it tried to allocate {format_bytes(tried)}" if tried is not None else f" ({text[:160]})"
        free = re.search(r"total capacity of ([0-9.]+ \w+) of which ([0-9.]+ \w+) is free", text)
        if free:  # CUDA's
            head += f" (the GPU had {free.group(2)} free of {free.group(1)})"
        if self.state is not None:
            parts = ", ".join(f"{k} {format_bytes(self.state[k])}" for k in ("params", "grads", "optimizer"))
            head += f"; its model state is {format_bytes(self.state['total'])} per rank ({self.strategy}: {parts})"
        lines = [head]
        if summary_file is not None:
            lines.append(f"  the allocator's memory summary is in {summary_file}")
        if self.plan:
            lines.append(f"  the plan said: {self.plan}")
        tries = settings_to_try(
            self.batch_size,
            self.accumulate,
            self.fixed,
            self.world_size,
            self.strategy,
            self.checkpointing,
            self.blocks,
        )
        if tries:
            lines.append("  settings that need less memory, to try:")
            lines += [f"    {t}" for t in tries]
        lines.append(f"  see the memory plan: {self.plan_command()}")
        if self.has_checkpoint():
            lines.append(f"  --resume continues from the last checkpoint in {self.run_dir / CKPT_DIR}")
        return "\n".join(lines)

    def has_checkpoint(self) -> bool:
        """Is there a checkpoint in the run directory to continue from (a save that failed leaves none)?"""
        try:
            return any(not p.name.startswith(".") for p in (self.run_dir / CKPT_DIR).iterdir())
        except OSError:
            return False

    def plan_command(self) -> str:
        """`ddpkit plan` of this run: its task and task arguments, processes, batch size, strategy."""
        words = ["ddpkit", "plan", self.task]
        for key, value in self.task_args.items():
            words += ["--task-arg", f"{key}={value}"]
        words += ["--nproc", str(self.nproc)] + (["--nnodes", str(self.nnodes)] if self.nnodes > 1 else [])
        words += ["--batch-size", str(self.batch_size)]
        if self.strategy != "ddp":
            words += ["--strategy", self.strategy]
        if self.precision != "fp32":
            words += ["--precision", self.precision]
        if self.checkpointing:
            words.append("--activation-checkpointing")
        return shlex.join(words)

    def save_summary(self) -> Path | None:
        """On a GPU: the CUDA allocator's memory summary in RUN_DIR/oom-rank-R.txt (its path), else None."""
        if self.device_type != "cuda":
            return None
        try:
            import torch

            path = self.run_dir / SUMMARY_FILE.format(rank=self.rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(torch.cuda.memory_summary() + "\n")
            return path
        except Exception:  # the error to report is the out-of-memory one
            return None
