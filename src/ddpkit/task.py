"""A training task: what the user's function builds (model, data, optimizer, loss, metric).

A task function is named as a built-in (``wine``), ``package.module:function`` or
``path/to/file.py:function``. It is called in every worker after the seed is set, so every
rank builds the same model. Its first parameter, when it has no default or is named
``config``/``cfg``, gets the RunConfig; ``--task-arg KEY=VALUE`` become keyword arguments,
checked against the signature.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .errors import DdpkitError

BUILTIN_TASKS = {
    "wine": "ddpkit.tasks.wine:build",
    "digits": "ddpkit.tasks.digits:build",
}

OptimizerSpec = torch.optim.Optimizer | Callable[..., torch.optim.Optimizer]
Metric = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Task:
    """What one training run needs: the model, the training data and the optimizer; the rest is
    optional. A task function returns one (or the guide's `(train_set, model, optimizer)`)."""

    model: nn.Module
    """The model, built the same on every rank (the task function runs after seeding); on the
    meta device for a model that does not fit one rank (see `init_weights`, `init_from`)."""
    train_set: Any
    """A map-style data set (a TensorDataset is batched by index), an IterableDataset or a
    `ddpkit.ShardedStream`. Items that are dicts are passed as keyword arguments."""
    optimizer: OptimizerSpec
    """An optimizer, or a factory `optimizer(params)`: under FSDP it is built over the shards (an
    instance is rebuilt as the same class with the same settings)."""
    eval_set: Any = None
    """Held-out data, evaluated every `--eval-every` epochs, each sample exactly once."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    """`loss_fn(outputs, targets)`, the batch mean. None: the loss the model's output carries (a
    `loss` attribute or key, or `(logits, loss)`), else cross-entropy."""
    metric: Metric | None = None
    """`metric(outputs, targets)` returns the batch's SUM (e.g. the number of correct
    predictions); ddpkit divides by the sample count over all ranks. None: accuracy, for
    classification outputs of `(inputs..., target)` items."""
    metric_name: str = "accuracy"
    """The metric's name in metrics.jsonl (`eval_<name>`)."""
    on_metrics: Callable[[dict[str, Any]], None] | None = None
    """`on_metrics(record)` is called on rank 0 after every epoch with that epoch's line of
    metrics.jsonl (a dict of global values, already reduced across ranks): the place to send
    them to W&B, MLflow or a notebook. It runs on rank 0 only, so it logs once."""
    fsdp_blocks: Callable[[nn.Module], Any] | None = None
    """--strategy fsdp: the submodules to shard one by one (then the root); None: each element of
    the model's ModuleLists, or the children of a Sequential (ddpkit.strategies.fsdp.default_blocks)."""
    checkpoint_blocks: Callable[[nn.Module], Any] | None = None
    """--activation-checkpointing: the submodules whose activations are recomputed in backward;
    None: the FSDP blocks above (fsdp_blocks, else the default), under DDP and FSDP alike."""
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    """`scheduler(optimizer)` or `scheduler(optimizer, total_steps)` -> a torch LR scheduler,
    stepped once per optimizer step (total_steps: the run's planned optimizer steps); its state
    is in every checkpoint. (Or --lr-schedule/--warmup-steps for the common shapes.)"""
    step: Callable[[nn.Module, Any], Any] | None = None
    """`step(model, batch)` -> the micro-batch's mean loss, or `(loss_sum, count)`: then ddpkit
    divides by the count over all micro-batches and ranks (token-level losses stay exact with
    padding)."""
    init_weights: Callable[[nn.Module], Any] | None = None
    """For a model built on the meta device (`with torch.device("meta"):`): called on every
    module that owns parameters or buffers, with them full-size for the moment, in
    model.modules() order (without it, each module's reset_parameters())."""
    init_from: str | os.PathLike[str] | None = None
    """Pretrained weights (a safetensors file, a Hugging Face folder, a torch state dict), of
    which each rank reads its part (`--init-from` on the command line)."""
    tokens_per_sample: int | None = None
    """The tokens one sample holds, for tokens/s (0: none). None: the length of a sample's first
    integer tensor of one dimension (token ids), if it has one."""
    tp_plan: dict[str, str] | None = None
    """--tp N: which modules to split, `{module-name pattern: style}` (`*` matches one name part,
    e.g. `"blocks.*.attn.q"`), styles `colwise`, `rowwise`, `sequence_parallel` as in Hugging Face's
    `base_model_tp_plan`. None: the model's own `base_model_tp_plan` (transformers models carry
    one). See docs/tensor-and-pipeline-parallel.md (strategies/tensor_parallel.py)."""


def accuracy_sum(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Number of correct class predictions in a batch."""
    return (outputs.argmax(dim=-1) == targets).sum()


def load_task_function(spec: str) -> Callable[..., Any]:
    """Find the function a task spec names; errors say how to name it right."""
    target = BUILTIN_TASKS.get(spec, spec)
    if ":" not in target:
        raise DdpkitError(
            f"unknown task {spec!r}: use a built-in ({', '.join(BUILTIN_TASKS)}), "
            "MODULE:FUNCTION or path/to/file.py:FUNCTION"
        )
    where, _, name = target.rpartition(":")
    if where.endswith(".py") or os.sep in where:
        path = os.path.abspath(where)
        if not os.path.isfile(path):
            raise DdpkitError(f"task file {where!r} does not exist")
        mod_name = "ddpkit_user_task_" + os.path.splitext(os.path.basename(path))[0]
        module = sys.modules.get(mod_name)
        if module is None or getattr(module, "__file__", None) != path:
            file_spec = importlib.util.spec_from_file_location(mod_name, path)
            assert file_spec and file_spec.loader
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[mod_name] = module
            sys.path.insert(0, os.path.dirname(path))  # let the file import its neighbours
            try:
                file_spec.loader.exec_module(module)
            except Exception as e:
                del sys.modules[mod_name]
                raise import_failure(f"task file {where!r}", e) from None
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(where)
        except Exception as e:
            missing = getattr(e, "name", None) if isinstance(e, ModuleNotFoundError) else None
            if missing and where.startswith(missing) or missing == where:
                raise DdpkitError(
                    f"task module {where!r} not found: check the name, or run from the folder that holds it"
                ) from None
            if where.split(".")[0] == __package__:
                raise  # a built-in task: a bug of ours, with its whole traceback
            raise import_failure(f"task module {where!r}", e) from None
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        raise DdpkitError(f"task {spec!r}: {where} has no function {name!r}")
    check_task_function(spec, fn)
    return fn


def check_task_function(spec: str, fn: Any) -> None:
    """Refuse, before it is called, what a spec (a flag, a config file) names that is not a
    function written to build a task: a builtin or a class (`os:system`, `subprocess:Popen`),
    or a function of Python's own library (`subprocess:run`, `shutil:rmtree`). Not a sandbox:
    a task file or module is code, and naming one runs it (README, Security); this keeps a spec
    from reaching, by mistake or by a file's say-so, what was never a task."""
    what = f"{getattr(fn, '__module__', None) or '?'}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    if not inspect.isfunction(fn):
        raise DdpkitError(
            f"task {spec!r} names {what}, a {type(fn).__name__}, not a Python function that builds a task "
            "(def build(config): return a Task, a dict of its fields or (train_set, model, optimizer))"
        )
    if (fn.__module__ or "").split(".")[0] in sys.stdlib_module_names:
        raise DdpkitError(f"task {spec!r} names {what}, a function of Python's own library, not a training task")


def import_failure(what: str, error: Exception) -> DdpkitError:
    """A task that raises while it is imported is the user's bug, not ours: one line naming
    the task and the error, then only the traceback from their code on (not ddpkit's frames
    that imported it, nor importlib's)."""

    def importing(frame: traceback.FrameSummary) -> bool:
        return frame.filename.startswith(("<frozen importlib", os.path.dirname(importlib.__file__) + os.sep))

    ours = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frames = traceback.extract_tb(error.__traceback__)
    while frames and (frames[0].filename.startswith(ours) or importing(frames[0])):
        frames.pop(0)
    lines = traceback.format_list([f for f in frames if not importing(f)])
    if isinstance(error, SyntaxError):  # where in the file it could not be parsed: the line and its caret
        lines += traceback.format_exception_only(type(error), error)[:-1]
    detail = "".join(lines).rstrip("\n")
    return DdpkitError(f"{what} failed at import: {type(error).__name__}: {error}" + (f"\n{detail}" if detail else ""))


def build_task(spec: str, config: Any = None, task_args: dict[str, Any] | None = None) -> Task:
    """Call the task function (with the RunConfig when it takes a first positional argument,
    and the --task-arg keywords) and check what it returned."""
    fn = load_task_function(spec)
    task_args = dict(task_args if task_args is not None else getattr(config, "task_args", None) or {})
    takes_config = check_task_call(spec, fn, task_args)
    built = fn(config, **task_args) if takes_config else fn(**task_args)
    return as_task(built, spec)


def check_task_call(spec: str, fn: Callable[..., Any], task_args: dict[str, Any]) -> bool:
    """Whether `fn` takes the RunConfig (a first parameter without default, or named
    config/cfg); refuses --task-arg names it does not take, naming the ones it does."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    first = positional[0] if positional else None
    takes_config = (
        first is not None
        and first.name not in task_args
        and (first.default is inspect.Parameter.empty or first.name in ("config", "cfg"))
    )
    if not task_args or any(p.kind is p.VAR_KEYWORD for p in params):
        return takes_config
    skip = first.name if takes_config else None
    takes = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != skip]
    unknown = sorted(set(task_args) - set(takes))
    if unknown:
        offer = ", ".join(takes) if takes else "no keyword arguments"
        raise DdpkitError(
            f"task {spec!r} takes no argument {', '.join(repr(u) for u in unknown)} (--task-arg); it takes: {offer}"
        )
    return takes_config


def as_task(built: Any, spec: str = "task") -> Task:
    """Accept a Task, a dict of its fields, or the guide's (train_set, model, optimizer)."""
    if isinstance(built, Task):
        task = built
    elif isinstance(built, dict):
        unknown = set(built) - set(Task.__dataclass_fields__)
        if unknown:
            raise DdpkitError(
                f"task {spec!r} returned unknown keys {sorted(unknown)}; allowed: {sorted(Task.__dataclass_fields__)}"
            )
        missing = {"model", "train_set", "optimizer"} - set(built)
        if missing:
            raise DdpkitError(f"task {spec!r} returned a dict without {sorted(missing)}")
        task = Task(**built)
    elif isinstance(built, (tuple, list)) and len(built) == 3:
        train_set, model, optimizer = built
        task = Task(model=model, train_set=train_set, optimizer=optimizer)
    else:
        raise DdpkitError(
            f"task {spec!r} returned {type(built).__name__}; return ddpkit.Task(...), a dict with "
            "model/train_set/optimizer (optionally eval_set, loss_fn, metric), or (train_set, model, optimizer)"
        )
    if not isinstance(task.model, nn.Module):
        raise DdpkitError(f"task {spec!r}: model must be a torch.nn.Module, got {type(task.model).__name__}")
    for name in ("train_set", "eval_set"):
        ds = getattr(task, name)
        if ds is None and name == "eval_set":
            continue
        if isinstance(ds, torch.utils.data.IterableDataset):
            if name == "train_set":
                continue  # a stream: dealt out by shard or round-robin (data/streams.py)
            raise DdpkitError(
                f"task {spec!r}: eval_set must be a map-style data set (with __len__ and __getitem__): exact "
                "evaluation cuts it into one slice per rank; a stream cannot be cut so (materialise a held-out part)"
            )
        if not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
            raise DdpkitError(
                f"task {spec!r}: {name} must be a map-style data set (with __len__ and __getitem__) or, for "
                f"training, a torch IterableDataset (e.g. ddpkit.ShardedStream); got {type(ds).__name__}"
            )
        if len(ds) == 0:
            raise DdpkitError(f"task {spec!r}: {name} is empty")
    if task.on_metrics is not None and not callable(task.on_metrics):
        raise DdpkitError(f"task {spec!r}: on_metrics must be a function of the epoch's metrics dict")
    for name, what in (
        ("scheduler", "of the optimizer, returning a torch LR scheduler"),
        ("step", "of (model, batch), returning the loss or (loss_sum, count)"),
        ("init_weights", "of a module, initialising its own parameters and buffers in place"),
        ("checkpoint_blocks", "of the model, returning the submodules whose activations to recompute"),
    ):
        value = getattr(task, name)
        if value is not None and not callable(value):
            raise DdpkitError(f"task {spec!r}: {name} must be a function {what}, got {type(value).__name__}")
    if not (isinstance(task.optimizer, torch.optim.Optimizer) or callable(task.optimizer)):
        raise DdpkitError(f"task {spec!r}: optimizer must be a torch.optim.Optimizer or a function of the parameters")
    return task
