"""The sizes the mesh plan (planning/mesh.py) needs, measured on the task's model as one tp rank of each
pipeline stage holds it: the model copied (a meta build costs nothing), its planned Linears
resized to their tp-local shapes (a colwise Linear keeps out_features / tp rows, a rowwise one
in_features / tp columns, its bias whole; an attention's head count divided as
strategies/tensor_parallel.py divides it), cut into stages by the pipeline's own split
(strategies/pipeline_split.py), then one forward of each stage at 1 and at 2 samples (on the
CPU, or on the meta device for a large model) that counts what autograd keeps, what each
stage sends the next, and the bytes entering the colwise and leaving the rowwise Linears
(what tp all-reduces). The figures at 1 and 2 samples give each one's fixed part and what
every sample adds."""

from __future__ import annotations

from copy import deepcopy
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils.data import default_collate

from ..parallel.footprints import ModelSizes
from ..planning.mesh import Linear, StageSizes
from ..strategies.activation import SavedBytes

HALF = {"bf16": torch.bfloat16, "fp16": torch.bfloat16}
REAL_PROBE_MAX = 1 << 30  # a tp-local copy up to this size runs on the CPU (its pages never written), else on meta


def localize(model: nn.Module, resolved: dict[str, str], tp: int) -> None:
    """Resize `model`'s planned Linears (in place) to what one of `tp` ranks holds of them."""
    from ..strategies.tensor_parallel import _head_counts

    modules = dict(model.named_modules())
    for parent, attr, heads in _head_counts(modules, resolved):
        setattr(modules[parent] if parent else model, attr, heads // tp)
    for name, style in resolved.items():
        m = modules[name]
        if style not in ("colwise", "rowwise") or not isinstance(m, nn.Linear):
            continue
        w = m.weight
        if style == "colwise":
            m.out_features //= tp
            m.weight = nn.Parameter(torch.empty(m.out_features, m.in_features, dtype=w.dtype, device=w.device))
            if m.bias is not None:
                m.bias = nn.Parameter(torch.empty(m.out_features, dtype=w.dtype, device=w.device))
        else:
            m.in_features //= tp
            m.weight = nn.Parameter(torch.empty(m.out_features, m.in_features, dtype=w.dtype, device=w.device))


def _tensors(value: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _nbytes(value: Any, grads_only: bool = False) -> int:
    return sum(
        t.numel() * t.element_size()
        for t in _tensors(value)
        if not grads_only or (t.is_floating_point() and t.requires_grad)
    )


class _TpCounter:
    """Bytes entering the colwise Linears and leaving the rowwise ones while it is on."""

    def __init__(self, model: nn.Module, resolved: dict[str, str]) -> None:
        self.forward = self.backward = 0
        self._handles = []
        modules = dict(model.named_modules())
        for name, style in resolved.items():
            if style == "colwise":
                self._handles.append(modules[name].register_forward_hook(self._colwise))
            elif style == "rowwise":
                self._handles.append(modules[name].register_forward_hook(self._rowwise))

    def _colwise(self, _: nn.Module, args: Any, out: Any) -> None:
        self.backward += _nbytes(args[0])

    def _rowwise(self, _: nn.Module, args: Any, out: Any) -> None:
        self.forward += _nbytes(out)

    def take(self) -> tuple[int, int]:
        got, self.forward, self.backward = (self.forward, self.backward), 0, 0
        return got

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def _stage_shapes(
    stage: nn.Module, blocks: list[nn.Module], per_param: float, precision: str
) -> tuple[ModelSizes, Any]:
    """The stage's parameters as the memory models see them, and those outside its blocks."""
    params = {id(p): p for p in stage.parameters()}
    inside = [b for b in blocks if any(id(p) in params for p in b.parameters())]
    in_blocks = {id(p) for b in inside for p in b.parameters()}
    shape = lambda p: (tuple(p.shape), p.element_size())  # noqa: E731
    block_sizes = [sum(p.numel() for p in b.parameters()) for b in inside]
    sizes = ModelSizes(
        tuple(shape(p) for p in params.values()),
        per_param,
        precision,
        root=sum(p.numel() for i, p in params.items() if i not in in_blocks),
        largest_block=max(block_sizes, default=0),
        blocks=len(inside),
    )
    return sizes, tuple(shape(p) for i, p in params.items() if i not in in_blocks)


def measure_stages(
    task: Any,
    *,
    tp: int,
    n_stages: int,
    blocks: Callable[[nn.Module], Iterable[nn.Module]],
    per_param: float,
    precision: str = "fp32",
) -> list[StageSizes]:
    """The `n_stages` stages (1: the whole model) of `task`'s model as one of `tp` ranks holds them."""
    from ..strategies.pipeline import _inputs_target
    from ..strategies.pipeline_split import split_model
    from ..strategies.tensor_parallel import check_plan, plan_of, resolve_plan
    from ..training.batches import compute_loss
    from ..training.probe import _first

    model = deepcopy(task.model)
    resolved: dict[str, str] = {}
    if tp > 1:
        resolved = resolve_plan(model, plan_of(model, task.tp_plan))
        check_plan(model, resolved, tp)
        localize(model, resolved, tp)
    if any(p.is_meta for p in model.parameters()):
        small = sum(p.numel() * p.element_size() for p in model.parameters()) <= REAL_PROBE_MAX
        model = model.to_empty(device="cpu") if small else model
    block_list = list(blocks(model))
    stages = split_model(model, n_stages, blocks) if n_stages > 1 else [model]
    shapes = [_stage_shapes(s, block_list, per_param, precision) for s in stages]
    half = HALF.get(precision)
    if half is not None:  # FSDP's mixed precision: each unit runs in half precision
        model.to(half)
    device = next(model.parameters()).device
    samples = _first(task.train_set, 2)
    counter = _TpCounter(model, resolved)
    figures: list[list[tuple[int, ...]]] = [[] for _ in stages]
    model.train()
    try:
        for n in (1, 2):
            batch = _on(default_collate(samples[:n]), device, half)
            if n_stages == 1:
                with torch.enable_grad(), SavedBytes() as saved:
                    compute_loss(model, batch, n, task.loss_fn, task.step, device)
                figures[0].append((saved.kept(), *counter.take(), 0, 0))
                continue
            inputs, target = _inputs_target(batch)
            for s, stage in enumerate(stages):
                with torch.enable_grad(), SavedBytes() as saved:
                    out = stage(*inputs)
                    if s == n_stages - 1:
                        task.loss_fn(out, target)
                sent = _nbytes(out) if s < n_stages - 1 else 0
                back = _nbytes(inputs, grads_only=True) if s > 0 else 0
                held = saved.kept() + sent + _nbytes(inputs)  # the stage keeps what it got and sent until backward
                figures[s].append((held, *counter.take(), sent, back))
                inputs = tuple(_received(t) for t in (out if isinstance(out, tuple) else (out,)))
    finally:
        counter.close()
    return [_stage(sizes, root, one, two) for (sizes, root), (one, two) in zip(shapes, figures, strict=True)]


def _stage(sizes: ModelSizes, root: Any, one: tuple[int, ...], two: tuple[int, ...]) -> StageSizes:
    lin = [Linear(a - (b - a), b - a) for a, b in zip(one, two, strict=True)]
    kept, forward, backward, sent, back = lin
    return StageSizes(sizes, root, forward, backward, sent, back, kept)


def _received(t: torch.Tensor) -> torch.Tensor:
    """A value as the next stage receives it: a leaf, with a gradient to send back if floating."""
    t = t.detach()
    return t.requires_grad_(True) if t.is_floating_point() else t


def _on(batch: Any, device: torch.device, half: torch.dtype | None) -> Any:
    from torch.utils._pytree import tree_map

    def move(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        t = t.to(device)
        return t.to(half) if half is not None and t.is_floating_point() else t

    return tree_map(move, batch)
