"""--grad-sync: DDP's gradient buckets summed in the job's shared-memory mapping
(runtime/shm.py) when every rank is on this machine's CPUs, else by the backend.

A DDP communication hook; a hook the user registers later on the same model takes over
(DDP allows one per model, so install() routes the user's registration here).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..config.performance import GRAD_SYNC_MODES
from ..config.processes import DEFAULT_TIMEOUT_S
from ..errors import DdpkitError
from ..runtime.shm import ShmAllReduce, why_not_shm
from .agreement import Agreement, backend_hook


def shm_hook(state, bucket):  # type: ignore[no-untyped-def]  (DDP checks annotations: none here)
    """DDP communication hook: `state` is the ShmAllReduce, `bucket` DDP's GradBucket (or,
    from DDP's Python reducer under compiled autograd, a (grad, param) pair reduced in place)."""
    if state.delegate is not None:
        hook, user_state = state.delegate
        return hook(user_state, bucket)
    if isinstance(bucket, tuple):
        grad = bucket[0]
        if state.fits(grad):
            state.all_reduce_mean_(grad)
        else:
            grad.div_(state.world)
            dist.all_reduce(grad, group=state.group)
        return None
    grad = bucket.buffer()
    agreement = state.agreement
    carry = None
    if agreement is not None and state.fits(grad) and state.small is not None:
        carry = agreement.take(bucket.index())  # the step's flags, in the first chunk's barrier
    before = state.waited_s
    fut = state.reduce_bucket(grad, carry)
    if agreement is not None:
        agreement.waited_s += state.waited_s - before
        if carry is not None:
            agreement.agreed = carry
    return fut


def _route_user_hooks(ddp_model: Any, state: Any, backend: str) -> None:
    """Let `ddp_model.register_comm_hook(state, hook)` (and DDP's built-in hook types) work
    after ddpkit installed its hook: the user's hook takes over every bucket, as it would
    on a plain DDP model (the mapping stays for the trainer's small all-reduces)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def register_comm_hook(user_state: object, hook: Any) -> None:
        if state.delegate is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        ddp_model._check_comm_hook(hook)
        if ddp_model.logger is not None:
            ddp_model.logger._set_comm_hook_name(hook.__qualname__)
        state.delegate = (hook, user_state)  # the mapping stays: small all-reduces still use it
        ddp_model._ddpkit_grad_sync = backend

    def register_builtin_comm_hook(comm_hook_type: Any) -> None:
        builtin = {
            dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
            dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
        }
        if comm_hook_type not in builtin:
            raise DdpkitError(
                f"built-in comm hook {comm_hook_type} unknown to ddpkit; wrap the model with grad_sync='backend'"
            )
        register_comm_hook(None, builtin[comm_hook_type])

    ddp_model.register_comm_hook = register_comm_hook
    ddp_model._register_builtin_comm_hook = register_builtin_comm_hook


def install(
    ddp_model: Any,
    mode: str,
    local_world_size: int,
    backend: str,
    device_type: str,
    say: Any = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> ShmAllReduce | None:
    """Register the shared-memory hook on a DDP model for --grad-sync auto|shm (None: not used).

    `auto` uses it where it can (one machine, CPU, gloo) and quietly keeps the backend
    otherwise; `shm` insists and raises DdpkitError with the reason when it cannot.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    if mode not in GRAD_SYNC_MODES:
        raise DdpkitError(f"--grad-sync must be one of {', '.join(GRAD_SYNC_MODES)}, got {mode!r}")
    if mode == "backend" or not isinstance(ddp_model, DDP):
        return None
    reason = why_not_shm(dist.get_world_size(), local_world_size, backend, device_type)
    if reason is None and getattr(ddp_model, "process_group", None) is not dist.group.WORLD:
        reason = "the model is replicated over a process subgroup, not the whole job"
    if reason is not None:
        if mode == "shm":
            raise DdpkitError(f"--grad-sync shm: {reason}; use --grad-sync auto or backend")
        return None
    numel = sum(p.numel() for p in ddp_model.module.parameters() if p.requires_grad)
    try:
        state = ShmAllReduce.create(
            numel, timeout=timeout
        )  # collective: every rank gets the mapping, or every rank raises
    except DdpkitError as e:
        if mode == "shm":
            raise
        if say is not None:
            say(f"ddpkit: gradients all-reduced by {backend}: {str(e).removeprefix('--grad-sync shm: ')}")
        return None
    ddp_model.register_comm_hook(state, shm_hook)
    _route_user_hooks(ddp_model, state, backend)
    return state


def carry_agreement(ddp_model: Any, mapping: ShmAllReduce | None, backend: str) -> Agreement | None:
    """Let the model's gradient sync carry the step's agreement (strategies/agreement.py):
    in the shared-memory sum, else in a hook doing the backend's all-reduce (a hook registered
    later takes over, as with the shared memory). None: not a DDP model over the whole job."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not isinstance(ddp_model, DDP) or getattr(ddp_model, "process_group", None) is not dist.group.WORLD:
        return None
    agreement = Agreement()
    if mapping is not None:
        mapping.agreement = agreement
        return agreement
    ddp_model.register_comm_hook(agreement, backend_hook)
    _route_user_hooks(ddp_model, agreement, backend)
    return agreement
