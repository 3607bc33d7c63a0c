"""A model cut into pipeline stages at block boundaries, each stage a module of its own layers.

The model's forward is traced once with torch.fx, its blocks (strategies/blocks.py: the
layers FSDP shards and activation checkpointing recomputes) kept as single calls; the graph is
cut before the first block of every stage but the first. Stage 0 gets what comes before the
first block (the embedding), the last stage what comes after the last block (the head; the
loss stays the task's, on the last stage). A value computed before a cut and used after it
(the hidden state, a mask, a position tensor) is sent to the next stage, and passed on
through the stages between.

Each stage is an fx.GraphModule over the original model: it holds only the modules and
parameters its part of the graph uses, under the original names (`blocks.3.attn.q.weight`),
so per-stage parameters, optimizer state and checkpoints use the whole model's FQNs and a
checkpoint written by stages loads into the whole model and back.

What cannot be cut is refused in one line before any worker trains: no blocks, fewer blocks
than stages, a forward torch.fx cannot trace (a Python branch on a tensor's value), a block
called twice or not at all, a parameter used on two stages (tied embedding and head).
"""

from __future__ import annotations

import bisect
from typing import Sequence

from torch import fx, nn

from ..errors import DdpkitError
from .blocks import BlocksHook, default_blocks


class _BlockTracer(fx.Tracer):
    """Keeps each block as one call (its insides are the stage's, not the graph's)."""

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        super().__init__()
        self._blocks = {id(b) for b in blocks}

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return id(m) in self._blocks or super().is_leaf_module(m, module_qualified_name)


def model_blocks(model: nn.Module, hook: BlocksHook | None = None) -> list[nn.Module]:
    return list(hook(model)) if hook is not None else default_blocks(model)


def cut_points(n_blocks: int, n_stages: int, splits: Sequence[int] | None = None) -> list[int]:
    """The index of the first block of each stage after the first: the task's `splits`, or the
    blocks shared as evenly as they go (the first stages take one more where they do not)."""
    if splits is not None:
        points = [int(s) for s in splits]
        if len(points) != n_stages - 1 or points != sorted(set(points)) or not all(0 < p < n_blocks for p in points):
            raise DdpkitError(
                f"--pp {n_stages}: the split points {list(splits)} must be {n_stages - 1} increasing block indices "
                f"between 1 and {n_blocks - 1} (the first block of each stage after the first)"
            )
        return points
    base, extra = divmod(n_blocks, n_stages)
    points, at = [], 0
    for s in range(n_stages - 1):
        at += base + (1 if s < extra else 0)
        points.append(at)
    return points


def split_model(
    model: nn.Module, n_stages: int, blocks: BlocksHook | None = None, splits: Sequence[int] | None = None
) -> list[fx.GraphModule]:
    """The model's `n_stages` stages, in order (every rank builds all of them from the same
    model and keeps its own: the weights do not depend on the mesh)."""
    found = model_blocks(model, blocks)
    what = f"--pp {n_stages}: {type(model).__name__}"
    if not found:
        raise DdpkitError(
            f"{what} has no blocks to cut into stages (no nn.ModuleList of layers, not an nn.Sequential): "
            "hold the layers in an nn.ModuleList, or give the task fsdp_blocks"
        )
    if len(found) < n_stages:
        raise DdpkitError(f"{what} has {len(found)} block(s), fewer than the {n_stages} stages asked: lower --pp")
    names = {id(m): name for name, m in model.named_modules()}
    block_names = [names[id(b)] for b in found]
    try:
        graph = _BlockTracer(found).trace(model)
    except Exception as e:  # torch.fx raises many kinds: each is a forward that cannot be cut
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DdpkitError(
            f"{what}'s forward cannot be traced into pipeline stages ({first}): write it as embedding, "
            "the blocks in order, head, without Python branches on tensor values"
        ) from None
    nodes = list(graph.nodes)
    at = _block_positions(nodes, block_names, what)
    starts = [at[block_names[p]] for p in cut_points(len(found), n_stages, splits)]
    stage_of = [bisect.bisect_right(starts, i) for i in range(len(nodes))]
    stages = [_stage_module(model, nodes, stage_of, s, n_stages) for s in range(n_stages)]
    _refuse_shared(stages, what)
    return stages


def _block_positions(nodes: list[fx.Node], block_names: list[str], what: str) -> dict[str, int]:
    """Where in the graph each block is called; each exactly once, in the blocks' order."""
    calls: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        if node.op == "call_module" and node.target in block_names:
            calls.setdefault(str(node.target), []).append(i)
    for name in block_names:
        if len(calls.get(name, [])) != 1:
            raise DdpkitError(
                f"{what}'s forward calls block {name} {len(calls.get(name, []))} times: pipeline stages need "
                "a forward that calls each block once, in order"
            )
    order = [calls[name][0] for name in block_names]
    if order != sorted(order):
        raise DdpkitError(f"{what}'s forward calls its blocks out of their order: pipeline stages need them in order")
    return {name: calls[name][0] for name in block_names}


def _stage_module(model: nn.Module, nodes: list[fx.Node], stage_of: list[int], s: int, n: int) -> fx.GraphModule:
    """Stage `s`: its nodes, the values it receives as inputs, those it sends as its output."""
    position = {node: i for i, node in enumerate(nodes)}

    def crossing(boundary: int) -> list[fx.Node]:  # values made before stage `boundary` and used from it on
        return [
            node
            for node in nodes
            if stage_of[position[node]] < boundary
            and node.op != "get_attr"
            and any(stage_of[position[u]] >= boundary for u in node.users)
        ]

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    if s > 0:
        for node in crossing(s):
            env[node] = graph.placeholder(node.name)
    for i, node in enumerate(nodes):
        if node.op == "output":
            if s == n - 1:
                graph.output(fx.map_arg(node.args[0], lambda a: env[a]))
            continue
        if node.op == "get_attr":
            if any(stage_of[position[u]] == s for u in node.users):
                env[node] = graph.node_copy(node, lambda a: env[a])
            continue
        if stage_of[i] == s and not (node.op == "placeholder" and s > 0):
            env[node] = graph.node_copy(node, lambda a: env[a])
    if s < n - 1:
        out = [env[node] for node in crossing(s + 1)]
        graph.output(out[0] if len(out) == 1 else tuple(out))
    graph.lint()
    return fx.GraphModule(model, graph, class_name=f"Stage{s}")


def _refuse_shared(stages: list[fx.GraphModule], what: str) -> None:
    """A tensor held by two stages would be two copies trained apart: refuse (tied weights)."""
    seen: dict[int, tuple[int, str]] = {}
    for s, stage in enumerate(stages):
        for name, t in [*stage.named_parameters(remove_duplicate=False), *stage.named_buffers(remove_duplicate=False)]:
            other = seen.get(id(t))
            if other is not None and other[0] != s:
                raise DdpkitError(
                    f"{what}: {name} (stage {s}) is the same tensor as {other[1]} (stage {other[0]}), a weight "
                    "shared across pipeline stages (tied embedding and head?): untie it, or train without --pp"
                )
            seen[id(t)] = (s, name)
