"""FSDP (PyTorch's FSDP2, `fully_shard`): parameters, gradients and optimizer state sharded
across the ranks, for models that do not fit one device with DDP.

Each block (see `default_blocks`, or the task's `fsdp_blocks` hook) becomes one FSDP unit,
then the root takes the rest: a unit's parameters are all-gathered just before it runs and
freed after, its gradients reduce-scattered after backward. Every rank keeps 1/N of each
parameter (dim 0), its gradient and its optimizer state. Works with NCCL on GPUs and with
gloo on CPUs.
"""

from __future__ import annotations

import contextlib
import weakref
from pathlib import Path
from typing import Any, ContextManager, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ..checkpoint.file import explained
from ..checkpoint.state import optimizer_state_by_name, unwrap, weights_to_save_now
from ..checkpoint.streamed import save_streamed
from ..errors import DdpkitError
from ..parallel.spec import StrategyConfig, check
from ..runtime import Runtime
from .base import Strategy
from .blocks import BlocksHook, default_blocks  # noqa: F401  (default_blocks: re-exported, where it was)
from .grad_norm import clip_global_norm_
from .local_step import step_on_local_shards
from .materialize import fill, on_meta
from .optimizers import OptimizerSpec, make_optimizer, rebuild_optimizer
from .tensor_parallel import split_model


class FsdpStrategy(Strategy):
    """Sharded model and optimizer; every rank writes its shard of each checkpoint (checkpoint/sharded.py)."""

    name = "fsdp"
    eval_lockstep = True  # a forward all-gathers: every rank must call it as often as the others
    checkpoint_kind = "sharded"

    def __init__(
        self,
        rt: Runtime,
        config: StrategyConfig | None = None,
        *,
        blocks: BlocksHook | None = None,
        mesh_shape: tuple[int, int] | None = None,
        checkpoint_blocks: BlocksHook | None = None,
    ) -> None:
        """`mesh_shape`: (replicate, shard), their product the world size. (1, N), the default,
        shards every parameter over all N ranks; (R, S) shards over S ranks and keeps R
        replicas of the shards, whose gradients are all-reduced (HSDP). `checkpoint_blocks`:
        what --activation-checkpointing recomputes (default: the blocks it shards)."""
        super().__init__(rt, config, checkpoint_blocks=checkpoint_blocks or blocks)
        if self.config.name == "hsdp":
            self.name = "hsdp"  # what the summary shows: the user asked for hsdp, even when R is 1
        if mesh_shape is not None:
            check(self.config, rt.world_size, mesh_shape=mesh_shape)
        self.mesh_shape = mesh_shape or (1, rt.world_size)
        self.blocks = blocks or default_blocks
        self._mesh: DeviceMesh | None = None  # what fully_shard shards over (the dp_shard sub-mesh under --tp)
        self._tp_mesh: DeviceMesh | None = None
        self.tp = rt.dims.tp
        # each sharded model's parameter names by the id of its unsharded parameters: what an
        # optimizer built before sharding holds (setup_optimizer rebuilds it over the shards)
        self._unsharded_names: weakref.WeakKeyDictionary[nn.Module, dict[int, str]] = weakref.WeakKeyDictionary()

    def device_mesh(self) -> DeviceMesh:
        """1-D over every rank without replicas; else 2-D, named, which fully_shard takes as HSDP.
        Under --tp one mesh (dp_replicate, dp_shard, tp), tp innermost (consecutive ranks, within a
        node: parallel/dims.py), of which FSDP takes the data-parallel sub-mesh, 2-D with replicas."""
        if self._mesh is None:
            replicate, shard = self.mesh_shape
            if self.tp > 1:
                names = ("dp_replicate", "dp_shard", "tp")
                mesh = init_device_mesh(self.rt.device.type, (replicate, shard, self.tp), mesh_dim_names=names)
                self._mesh = mesh["dp_replicate", "dp_shard"] if replicate > 1 else mesh["dp_shard"]
                self._tp_mesh = mesh["tp"]
            elif replicate == 1:
                self._mesh = init_device_mesh(self.rt.device.type, (shard,))
            else:
                self._mesh = init_device_mesh(
                    self.rt.device.type, (replicate, shard), mesh_dim_names=("replicate", "shard")
                )
        return self._mesh

    def setup_module(self, model: nn.Module) -> nn.Module:
        if not on_meta(model):  # a meta build is materialised after sharding, by fill()
            model = model.to(self.rt.device)
            _broadcast_from_rank0(model)  # as DDP does: every rank shards the same weights
        names = {id(p): n for n, p in model.named_parameters()}
        mesh = self.device_mesh()
        mp = root_mp = MixedPrecisionPolicy()
        if self.dtype is not None:  # compute in bf16, keep fp32 master weights, reduce in fp32, return fp32
            mp = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
            root_mp = MixedPrecisionPolicy(
                param_dtype=self.dtype, reduce_dtype=torch.float32, output_dtype=torch.float32
            )
        blocks = list(self.blocks(model))
        own = {id(m) for m in model.modules()}
        if any(b is model or id(b) not in own for b in blocks):
            raise DdpkitError(
                "the task's fsdp_blocks(model) must return submodules of the model (not the model itself)"
            )
        if self.tp > 1:  # the Linears split over the tp ranks first, then their shards sharded over dp
            split_model(model, self.tp_plan, self._tp_mesh)
        self.checkpoint_activations(model)
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=root_mp)
        # --compile: each block's forward inside FSDP's (and checkpointing's) eager hooks, the root eager
        self.compile_blocks(model, self.checkpointed or blocks)
        fill(model, self.rt.device, self.model_init(model))  # meta -> this rank's shards; pretrained weights
        self.units = len(blocks) + 1
        self._unsharded_names[model] = names
        return model

    def setup_optimizer(self, spec: OptimizerSpec, model: nn.Module, lr: float | None = None) -> torch.optim.Optimizer:
        """fully_shard replaced the parameters: a factory builds over the shards; an instance
        built before sharding is rebuilt over them (same class and settings). Its step runs
        on the local shards (local_step.py: the same numbers without DTensor's dispatch)."""
        if isinstance(spec, torch.optim.Optimizer):
            rebuilt = rebuild_sharded_optimizer(spec, model, self._unsharded_names.get(model, {}))
            spec.param_groups.clear()  # let go of the unsharded parameters it held
            spec.state.clear()
            spec = rebuilt
        return step_on_local_shards(make_optimizer(spec, model, lr))

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Under --tp the parameters live on two meshes (split Linears on the whole mesh, the rest
        on its data-parallel sub-mesh), which torch's clip_grad_norm_ cannot stack: grad_norm.py's global norm."""
        if self.tp == 1:
            return super().clip_grad_norm_(model, max_norm)
        return clip_global_norm_(model.parameters(), max_norm, self.rt.world_size)

    def autocast(self) -> ContextManager[Any]:
        return contextlib.nullcontext()  # MixedPrecisionPolicy casts inside the units

    def no_sync(self, model: nn.Module, skip_sync: bool) -> ContextManager[Any]:
        """FSDP2: no reduce-scatter while skipping (unsharded gradients accumulate); the
        step's last micro-batch reduce-scatters the sum once."""
        return _gradient_sync(model, not skip_sync)

    def check_output(self, output: Any) -> None:
        """FSDP2 finds the output's tensors with torch's pytree to hook the backward that
        reduce-scatters the gradients; tensors inside an object it cannot traverse (a
        SimpleNamespace, a plain class) are invisible, and the gradients are silently never
        synced (measured: a model 0.7 away from the DDP run). Refuse that."""
        from torch.utils._pytree import tree_leaves

        if not any(isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in tree_leaves(output)):
            raise DdpkitError(
                f"--strategy fsdp: the model returned a {type(output).__name__} whose tensors FSDP cannot see, "
                "so its gradients would never be synced; return a tensor, a tuple, list or dict of tensors, or a "
                "dataclass registered with torch.utils._pytree (Hugging Face ModelOutput is)"
            )

    def save_full_model(self, model: nn.Module, path: Path) -> None:
        """Collective: the whole model gathered tensor by tensor, each written by rank 0 and
        dropped (checkpoint/streamed.py): rank 0 never holds more than its shards and one
        whole tensor. A full disk is one clear error on rank 0, nothing partial left."""
        state = unwrap(model).state_dict()
        whole = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
        with explained(path):
            save_streamed(path, state.items(), whole, lambda t: tuple(t.shape), self.rt.is_main)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """Collective: every rank sends its shards, rank 0 gets the plain tensors on its CPU."""
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return weights_to_save_now(state) if self.rt.is_main else None

    @property
    def shard(self) -> tuple[int, int]:
        """(this rank's shard index, the number of shards): which part of every parameter it
        holds. The mesh is (replicate, shard) over the ranks in order, so the index is the rank
        modulo the shards (HSDP's default: a node's local rank)."""
        shards = self.mesh_shape[1] * self.tp  # under --tp every rank holds a different piece
        return self.rt.rank % shards, shards

    def local_shards(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's shards of the model and optimizer as plain CPU tensors (a copy the
        training does not change), keyed by parameter name: what a memory snapshot keeps.
        No collective."""
        model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": _to_local(model_state), "optim": _to_local(optim_state), "shard": self.shard}

    def load_local_shards(self, model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
        """What local_shards kept (this shard index's, from any rank that held it) into this
        rank's part of the model and optimizer. Every parameter is laid out as before (the same
        number of shards), so each local tensor goes back where it was; placements come from this
        run's mesh (HSDP on one node after the loss of the others is a 1-D mesh)."""
        if tuple(saved["shard"]) != self.shard:
            raise DdpkitError(f"a snapshot of shard {tuple(saved['shard'])} offered to shard {self.shard}")
        params = dict(get_model_state_dict(model))
        model_state = _from_local(saved["model"], lambda name, _: params[name])
        optim = saved["optim"]
        state = {name: _from_local(per, lambda _, __, name=name: params[name]) for name, per in optim["state"].items()}
        set_state_dict(
            model,
            optimizer,
            model_state_dict=model_state,
            optim_state_dict={"state": state, "param_groups": optim["param_groups"]},
        )

    def load_full(self, model: nn.Module, optimizer: torch.optim.Optimizer, ckpt: dict[str, Any]) -> None:
        """A one-file (DDP) checkpoint into the sharded model: every rank keeps its part."""
        set_state_dict(
            model,
            optimizer,
            model_state_dict=ckpt["model"],
            optim_state_dict=optimizer_state_by_name(model, optimizer, ckpt["optimizer"]),
            options=StateDictOptions(full_state_dict=True),
        )


LOCAL_SHARD = "__ddpkit_local_shard__"  # {LOCAL_SHARD: tensor}: a DTensor's local part in a memory snapshot


def _to_local(state: Any) -> Any:
    """A nested state with each DTensor replaced by {LOCAL_SHARD: its local tensor} and every
    tensor copied to the CPU: plain data, which a snapshot loads with weights_only=True."""
    if isinstance(state, DTensor):
        return {LOCAL_SHARD: state.to_local().detach().to("cpu", copy=True)}
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _to_local(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to_local(v) for v in state)
    return state


def _from_local(state: dict[str, Any], like: Any) -> dict[str, Any]:
    """`_to_local`'s flat dict back: each local part a DTensor laid out as `like(key, value)`
    (the parameter it belongs to); a local shape that differs is refused, never reshaped."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict) and set(value) == {LOCAL_SHARD}:
            local = value[LOCAL_SHARD]
            ref = like(key, value)
            if not isinstance(ref, DTensor) or tuple(ref.to_local().shape) != tuple(local.shape):
                raise DdpkitError(f"a memory snapshot's shard of {key} does not fit this run's layout")
            value = DTensor.from_local(
                local.to(ref.device),
                ref.device_mesh,
                ref.placements,
                run_check=False,
                shape=ref.shape,
                stride=ref.stride(),
            )
        out[key] = value
    return out


@contextlib.contextmanager
def _gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    if enabled or not hasattr(model, "set_requires_gradient_sync"):
        yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def rebuild_sharded_optimizer(
    opt: torch.optim.Optimizer, model: nn.Module, names: dict[int, str]
) -> torch.optim.Optimizer:
    """The same optimizer class, with the same param groups and settings, over the sharded
    parameters (its state, if it had any, starts fresh)."""
    params = dict(model.named_parameters())
    if any(id(p) not in names for g in opt.param_groups for p in g["params"]):
        raise DdpkitError(
            "the task's optimizer holds parameters that are not the model's; "
            "give the optimizer as a function of the parameters: optimizer=lambda params: ..."
        )
    try:
        return rebuild_optimizer(opt, lambda p: params[names[id(p)]])
    except DdpkitError as e:
        raise DdpkitError(f"--strategy fsdp builds the optimizer after sharding and {e}") from None


def _broadcast_from_rank0(model: nn.Module) -> None:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    with torch.no_grad():
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)
