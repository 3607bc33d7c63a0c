"""Tensor parallelism (--tp N): which Linear layers are split over the `tp` ranks, and how.

A plan maps module-name patterns to styles, the strings of Hugging Face's `base_model_tp_plan`
(`*` matches one part of a dotted name, e.g. `layers.*.self_attn.q_proj`):

  * `colwise`: the Linear's output features are split (each tp rank computes its slice, the
    input whole); the attention's q/k/v and an MLP's up projections.
  * `rowwise`: the input features are split and the partial outputs summed over the tp ranks;
    the projection that follows a colwise one (the attention's output, an MLP's down).
  * `sequence_parallel`: a norm between them. It runs whole on every tp rank here: exact, without
    sequence parallelism's activation saving.

The plan is resolved and checked before anything trains (`resolve_plan`, `check_plan`): every
pattern must match a module, every split dimension must divide by tp, a q/k/v fused into one
Linear is refused (a column split of it cuts across q, k and v, not between heads). An attention
that keeps its head count in an attribute (`n_head`, `num_heads`...) gets the local count; one
that views heads from the tensor (`view(B, T, -1, head_dim)`) needs nothing.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from ..errors import DdpkitError

STYLES = ("colwise", "rowwise", "sequence_parallel")
# the attributes an attention keeps its head counts in: divided by tp on the attention whose q/k/v are split
HEAD_ATTRS = ("n_head", "n_heads", "num_heads", "num_attention_heads", "n_kv_head", "n_kv_heads", "num_key_value_heads")
FUSED_QKV = ("qkv", "c_attn", "in_proj", "wqkv", "qkv_proj", "query_key_value")


def plan_of(model: nn.Module, plan: dict[str, str] | None) -> dict[str, str]:
    """The task's plan, else the model's own `base_model_tp_plan` (a transformers model's config
    carries it, its names under the base model's prefix); refused when there is neither."""
    if plan:
        return dict(plan)
    config = getattr(model, "config", None)
    own = getattr(model, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None)
    if not own:
        raise DdpkitError(
            f"--tp: the model ({type(model).__name__}) has no tensor-parallel plan: give the task "
            'tp_plan={"blocks.*.attn.q": "colwise", ...} (see docs/tensor-and-pipeline-parallel.md)'
        )
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        return {f"{prefix}.{pattern}": style for pattern, style in own.items()}
    return dict(own)


def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")))


def resolve_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Each module the plan names -> its style; refused: an unknown style, a pattern that matches
    no module, a module two patterns give different styles."""
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise DdpkitError(
                f"tp_plan {pattern!r}: style {style!r} is not one ddpkit applies; use one of {', '.join(STYLES)}"
            )
        matched = [n for n in names if _regex(pattern).fullmatch(n)]
        if not matched:
            raise DdpkitError(
                f"tp_plan {pattern!r} matches no module of {type(model).__name__}: name modules as "
                f"model.named_modules() does (e.g. {names[0] if names else 'blocks.0.attn.q'!r}), * for one part"
            )
        for name in matched:
            if resolved.setdefault(name, style) != style:
                raise DdpkitError(f"tp_plan gives {name!r} two styles ({resolved[name]}, {style}): keep one")
    return resolved


def check_plan(model: nn.Module, resolved: dict[str, str], tp: int) -> None:
    """Refuse, in one line, a split that cannot be made or would be wrong: a colwise/rowwise
    module that is not a Linear, a fused q/k/v, a dimension or a head count not divisible by tp."""
    modules = dict(model.named_modules())
    for name, style in resolved.items():
        module = modules[name]
        if style == "sequence_parallel":
            continue
        if not isinstance(module, nn.Linear):
            raise DdpkitError(
                f"tp_plan: {name} is a {type(module).__name__}, not a Linear: {style} splits Linears only"
            )
        last = name.rsplit(".", 1)[-1].lower()
        if style == "colwise" and last in FUSED_QKV:
            raise DdpkitError(
                f"{name}: q/k/v fused into one Linear cannot be column-split by heads: split it or give tp_plan"
            )
        size, what = (module.out_features, "output") if style == "colwise" else (module.in_features, "input")
        if size % tp:
            raise DdpkitError(
                f"--tp {tp}: {name}'s {size} {what} features do not divide by {tp}: choose a --tp dividing {size}"
            )
    for parent, attr, heads in _head_counts(modules, resolved):
        if heads % tp:
            raise DdpkitError(f"--tp {tp}: {parent or 'the model'}.{attr} = {heads} heads do not divide by {tp}")


def _head_counts(modules: dict[str, nn.Module], resolved: dict[str, str]) -> list[tuple[str, str, int]]:
    """(attention's name, attribute, head count) of each attention one of whose children is split colwise."""
    parents = {name.rsplit(".", 1)[0] if "." in name else "" for name, s in resolved.items() if s == "colwise"}
    found = []
    for parent in sorted(parents):
        module = modules[parent]
        for attr in HEAD_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                found.append((parent, attr, value))
    return found


def apply_plan(model: nn.Module, resolved: dict[str, str], tp_mesh: Any) -> None:
    """Split the planned Linears over `tp_mesh` (torch.distributed.tensor.parallel) and give the
    attentions their local head counts. Norms (`sequence_parallel`) stay whole on every rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    for parent, attr, heads in _head_counts(dict(model.named_modules()), resolved):
        setattr(model.get_submodule(parent) if parent else model, attr, heads // tp)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {name: styles[style]() for name, style in resolved.items() if style in styles}
    parallelize_module(model, tp_mesh, plan)


def split_model(model: nn.Module, plan: dict[str, str] | None, tp_mesh: Any) -> None:
    """The task's plan (or the model's own) resolved, checked and applied over `tp_mesh`: what a
    strategy calls before it shards or replicates the model over the data-parallel ranks."""
    from .materialize import on_meta

    if on_meta(model):
        raise DdpkitError(
            "--tp: a model built on the meta device cannot be split yet; build it on the CPU, or drop --tp"
        )
    resolved = resolve_plan(model, plan_of(model, plan))
    check_plan(model, resolved, tp_mesh.size())
    apply_plan(model, resolved, tp_mesh)
