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
from typing import Any, Callable, ContextManager, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ..errors import DdpkitError
from ..runtime import Runtime
from .base import Strategy
from .optimizers import make_optimizer, rebuild_optimizer

BlocksHook = Callable[[nn.Module], Iterable[nn.Module]]


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules to shard one by one: every element of the model's outermost
    nn.ModuleLists (transformer layers, MLP stacks); without any, the children of a
    Sequential root that hold parameters. Whatever is left (embeddings, head) goes to the root."""
    blocks: list[nn.Module] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue
        if isinstance(module, nn.ModuleList):
            for i, child in enumerate(module):
                if _has_params(child):
                    blocks.append(child)
                    inside.append(f"{name}.{i}" if name else str(i))
    if not blocks and isinstance(model, nn.Sequential):
        blocks = [child for child in model if _has_params(child)]
    return blocks


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


class FsdpStrategy(Strategy):
    """Sharded model and optimizer; every rank writes its shard of each checkpoint (checkpoint/sharded.py)."""

    name = "fsdp"
    eval_lockstep = True  # a forward all-gathers: every rank must call it as often as the others
    checkpoint_kind = "sharded"

    def __init__(self, rt: Runtime, precision: str = "fp32", cfg: Any = None, blocks: BlocksHook | None = None) -> None:
        super().__init__(rt, precision, cfg)
        self.blocks = blocks or default_blocks

    def setup(self, task: Any, lr: float | None) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = task.model.to(self.rt.device)
        _broadcast_from_rank0(model)  # as DDP does: every rank shards the same weights
        names = {id(p): n for n, p in model.named_parameters()}
        mesh = init_device_mesh(self.rt.device.type, (self.rt.world_size,))
        mp = root_mp = MixedPrecisionPolicy()
        if self.dtype is not None:  # compute in bf16, keep fp32 master weights, reduce in fp32, return fp32
            mp = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
            root_mp = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32, output_dtype=torch.float32)
        blocks = list(self.blocks(model))
        own = {id(m) for m in model.modules()}
        if any(b is model or id(b) not in own for b in blocks):
            raise DdpkitError("the task's fsdp_blocks(model) must return submodules of the model (not the model itself)")
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=root_mp)
        self.units = len(blocks) + 1
        # fully_shard replaced the parameters, so the optimizer is built now, over the shards.
        spec = task.optimizer
        if isinstance(spec, torch.optim.Optimizer):
            rebuilt = rebuild_sharded_optimizer(spec, model, names)
            spec.param_groups.clear()  # let go of the unsharded parameters it held
            spec.state.clear()
            task.optimizer = spec = rebuilt
        return model, make_optimizer(spec, model, lr)

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
            raise DdpkitError(f"--strategy fsdp: the model returned a {type(output).__name__} whose tensors FSDP cannot see, "
                              "so its gradients would never be synced; return a tensor, a tuple, list or dict of tensors, or a "
                              "dataclass registered with torch.utils._pytree (Hugging Face ModelOutput is)")

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        """The norm over every shard (the gradients are DTensors: their norm is a collective)."""
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """Collective: every rank sends its shards, rank 0 gets the plain tensors on its CPU."""
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k: v.detach().clone() for k, v in state.items()} if self.rt.is_main else None

    def load_full(self, model: nn.Module, optimizer: torch.optim.Optimizer, ckpt: dict[str, Any]) -> None:
        """A one-file (DDP) checkpoint into the sharded model: every rank keeps its part."""
        fqns = optimizer_param_names(model, optimizer)
        saved = ckpt["optimizer"]
        optim_state = {
            "state": {fqns[i]: s for i, s in saved["state"].items()},
            "param_groups": [{**g, "params": [fqns[i] for i in g["params"]]} for g in saved["param_groups"]],
        }
        set_state_dict(model, optimizer, model_state_dict=ckpt["model"], optim_state_dict=optim_state,
                       options=StateDictOptions(full_state_dict=True))


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


def rebuild_sharded_optimizer(opt: torch.optim.Optimizer, model: nn.Module, names: dict[int, str]) -> torch.optim.Optimizer:
    """The same optimizer class, with the same param groups and settings, over the sharded
    parameters (its state, if it had any, starts fresh)."""
    params = dict(model.named_parameters())
    if any(id(p) not in names for g in opt.param_groups for p in g["params"]):
        raise DdpkitError("the task's optimizer holds parameters that are not the model's; "
                          "give the optimizer as a function of the parameters: optimizer=lambda params: ...")
    try:
        return rebuild_optimizer(opt, lambda p: params[names[id(p)]])
    except DdpkitError as e:
        raise DdpkitError(f"--strategy fsdp builds the optimizer after sharding and {e}") from None


def optimizer_param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the optimizer's parameters, in the order its state_dict numbers them."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


def _broadcast_from_rank0(model: nn.Module) -> None:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    with torch.no_grad():
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)
