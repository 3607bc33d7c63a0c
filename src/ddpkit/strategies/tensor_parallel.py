"""Tensor parallelism (--tp N): which Linear layers are split over the `tp` ranks, and how.

A plan maps module-name patterns to styles, the strings of Hugging Face's `base_model_tp_plan`
(`*` matches one part of a dotted name, e.g. `layers.*.self_attn.q_proj`), each applied as
torch.distributed.tensor.parallel builds it:

  * `colwise`: the Linear's output features are split (each tp rank computes its slice, the
    input whole); the attention's q/k/v and an MLP's up projections. `colwise_rep` (or
    `colwise_gather_output`): the same, the slices gathered after (a head whose logits the loss
    takes whole).
  * `rowwise`: the input features are split and the partial outputs summed over the tp ranks;
    the projection that follows a colwise one (the attention's output, an MLP's down).
    `rowwise_rep` (or `rowwise_split_input`): its input comes whole and is split first.
  * `embedding_rowwise`, `embedding_colwise`: an Embedding's rows (the vocabulary) or columns
    split, its output summed or gathered whole.
  * `sequence_parallel`, `replicate`: a norm (or any module) that runs whole on every tp rank
    here: exact, without sequence parallelism's activation saving.

The plan is resolved and checked before anything trains (`resolve_plan`, `check_plan`): every
pattern must match a module, every split dimension must divide by tp, a q/k/v fused into one
Linear is refused (a column split of it cuts across q, k and v, not between heads), and so is a
split that cuts a head (`head_dim`) in two. An attention that keeps its head count in an
attribute (`n_head`, `num_heads`...) gets the local count; one that views heads from the tensor
(`view(B, T, -1, head_dim)`, as transformers' Llama does) needs nothing. A parameter two modules
share (a tied embedding and head) stays one parameter when both split it the same way, and is
refused when they do not.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from ..errors import DdpkitError

# style -> (the module it splits, the dimension that must divide by tp, the weight's split dim);
# None: the module runs whole on every tp rank
SPLITS: dict[str, tuple[type[nn.Module], str, int] | None] = {
    "colwise": (nn.Linear, "out_features", 0),
    "colwise_rep": (nn.Linear, "out_features", 0),
    "colwise_gather_output": (nn.Linear, "out_features", 0),
    "rowwise": (nn.Linear, "in_features", 1),
    "rowwise_rep": (nn.Linear, "in_features", 1),
    "rowwise_split_input": (nn.Linear, "in_features", 1),
    "embedding_rowwise": (nn.Embedding, "num_embeddings", 0),
    "embedding_colwise": (nn.Embedding, "embedding_dim", 1),
    "sequence_parallel": None,
    "replicate": None,
}
STYLES = tuple(SPLITS)
DIM_WORDS = {
    "out_features": "output features",
    "in_features": "input features",
    "num_embeddings": "embedding rows",
    "embedding_dim": "embedding columns",
}
COLWISE = ("colwise", "colwise_rep", "colwise_gather_output")
# the attributes an attention keeps its head counts in: divided by tp on the attention whose q/k/v are split
HEAD_ATTRS = ("n_head", "n_heads", "num_heads", "num_attention_heads", "n_kv_head", "n_kv_heads", "num_key_value_heads")
FUSED_QKV = ("qkv", "c_attn", "in_proj", "wqkv", "qkv_proj", "query_key_value")


def plan_of(model: nn.Module, plan: dict[str, str] | None) -> dict[str, str]:
    """The task's plan, else the model's own: a transformers model's `_tp_plan` (its config's
    `base_model_tp_plan` under the base model's prefix, with the head's entry), else the
    `base_model_tp_plan` it or its config carries; refused when there is none."""
    if plan:
        return dict(plan)
    whole = getattr(model, "_tp_plan", None)
    if isinstance(whole, dict) and whole:
        return dict(whole)
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
        if style not in SPLITS:
            raise DdpkitError(
                f"tp_plan {pattern!r}: style {style!r} is not one ddpkit applies; use one of {', '.join(STYLES)} "
                "(a model's own plan with others: give the task a tp_plan of these)"
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
    """Refuse, in one line, a split that cannot be made or would be wrong: a module of the wrong
    kind for its style, a fused q/k/v, a dimension, a head count or a head not divisible by tp,
    a tied parameter split two ways."""
    modules = dict(model.named_modules())
    for name, style in resolved.items():
        split = SPLITS[style]
        if split is None:
            continue
        kind, dim, _ = split
        module = modules[name]
        if not isinstance(module, kind):
            raise DdpkitError(
                f"tp_plan: {name} is a {type(module).__name__}, not {_a(kind.__name__)}: {style} splits "
                f"{kind.__name__}s only"
            )
        last = name.rsplit(".", 1)[-1].lower()
        if style in COLWISE and last in FUSED_QKV:
            raise DdpkitError(
                f"{name}: q/k/v fused into one Linear cannot be column-split by heads: split it or give tp_plan"
            )
        size = getattr(module, dim)
        if size % tp:
            what = DIM_WORDS[dim]
            raise DdpkitError(f"--tp {tp}: {name}'s {size} {what} do not divide by {tp}: choose a --tp dividing {size}")
    _check_heads(modules, resolved, tp)
    _tied_groups(model, resolved)


def _check_heads(modules: dict[str, nn.Module], resolved: dict[str, str], tp: int) -> None:
    """Each rank's slice of a colwise q/k/v holds whole heads, and a head-count attribute divides."""
    for parent, attr, heads in _head_counts(modules, resolved):
        if heads % tp:
            raise DdpkitError(f"--tp {tp}: {parent or 'the model'}.{attr} = {heads} heads do not divide by {tp}")
    for name, style in resolved.items():
        parent = modules[name.rsplit(".", 1)[0]] if "." in name else None
        head_dim = getattr(parent, "head_dim", None)
        if style in COLWISE and isinstance(head_dim, int) and head_dim > 0:
            heads, part = divmod(modules[name].out_features, head_dim)
            if not part and heads % tp:
                raise DdpkitError(
                    f"--tp {tp}: {name} holds {heads} head(s) of {head_dim} features, which {tp} ranks cannot "
                    f"share without cutting a head: choose a --tp dividing {heads}"
                )


def _head_counts(modules: dict[str, nn.Module], resolved: dict[str, str]) -> list[tuple[str, str, int]]:
    """(attention's name, attribute, head count) of each attention one of whose children is split colwise."""
    parents = {name.rsplit(".", 1)[0] for name, s in resolved.items() if s in COLWISE and "." in name}
    found = []
    for parent in sorted(parents):
        module = modules[parent]
        for attr in HEAD_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                found.append((parent, attr, value))
    return found


def _tied_groups(model: nn.Module, resolved: dict[str, str]) -> list[list[tuple[str, str]]]:
    """The (module, parameter name) places of each parameter that several modules share and the
    plan splits in one of them; refused when they would split it differently (a tied head and
    embedding: one colwise, the other whole), which would silently untie it."""
    places: dict[int, list[tuple[str, str]]] = {}
    for name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            places.setdefault(id(param), []).append((name, pname))
    groups = []
    for group in places.values():
        if len(group) < 2 or not any(m in resolved for m, _ in group):
            continue
        ways = {(m, p): _split_of(resolved.get(m), p) for m, p in group}
        if len(set(ways.values())) > 1:
            said = ", ".join(f"{m}.{p} {_way(way)}" for (m, p), way in ways.items())
            raise DdpkitError(
                f"tp_plan: one tied parameter would be split two ways ({said}): give each module that shares it "
                "the same split (e.g. embedding_rowwise with colwise_rep), or untie it"
            )
        groups.append(group)
    return groups


def _a(word: str) -> str:
    return f"an {word}" if word[0] in "AEIOU" else f"a {word}"


def _split_of(style: str | None, param: str) -> str:
    split = SPLITS.get(style) if style else None
    if split is None:
        return "whole"
    if style and style.startswith("rowwise") and param == "bias":
        return "replicated"
    return f"dim {split[2]}"


def _way(way: str) -> str:
    return "kept whole" if way == "whole" else f"split on {way}" if way.startswith("dim") else way


def torch_style(style: str) -> Any:
    """The torch.distributed.tensor.parallel style that builds `style` (None: kept whole)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if SPLITS[style] is None:
        return None
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style in ("colwise_rep", "colwise_gather_output", "embedding_colwise"):
        return ColwiseParallel(output_layouts=Replicate())
    return RowwiseParallel(input_layouts=Replicate())  # rowwise_rep, rowwise_split_input, embedding_rowwise


def apply_plan(model: nn.Module, resolved: dict[str, str], tp_mesh: Any) -> None:
    """Split the planned modules over `tp_mesh` (torch.distributed.tensor.parallel), give the
    attentions their local head counts, and tie again what was tied. Modules kept whole
    (`sequence_parallel`, `replicate`) stay as they are on every rank."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    for parent, attr, heads in _head_counts(dict(model.named_modules()), resolved):
        setattr(model.get_submodule(parent), attr, heads // tp)
    tied = _tied_groups(model, resolved)
    plan = {name: torch_style(style) for name, style in resolved.items() if SPLITS[style] is not None}
    parallelize_module(model, tp_mesh, plan)
    for group in tied:  # each planned module got its own split copy: one parameter again
        (first, pname), rest = group[0], group[1:]
        shared = getattr(model.get_submodule(first), pname)
        for module, name in rest:
            setattr(model.get_submodule(module), name, shared)


def split_model(model: nn.Module, plan: dict[str, str] | None, tp_mesh: Any) -> None:
    """The task's plan (or the model's own) resolved, checked and applied over `tp_mesh`: what a
    strategy calls before it shards or replicates the model over the data-parallel ranks."""
    from .materialize import on_meta

    if on_meta(model):
        raise DdpkitError(
            "--tp: a model built on the meta device cannot be split yet; build it on the CPU, or drop --tp"
        )
    apply_plan(model, checked_plan(model, plan, tp_mesh.size()), tp_mesh)


def checked_plan(model: nn.Module, plan: dict[str, str] | None, tp: int) -> dict[str, str]:
    """The plan resolved against `model` and checked for `tp` ranks (each module -> its style): what
    the launcher asks of a model built on the meta device before any worker starts, and every
    worker again before it splits its own."""
    resolved = resolve_plan(model, plan_of(model, plan))
    check_plan(model, resolved, tp)
    return resolved
