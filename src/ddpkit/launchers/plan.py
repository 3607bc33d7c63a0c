"""From a RunConfig to a LaunchPlan: processes per node, rendezvous, addresses.

Rules (torchrun's, without the guide's mistakes): world size = nnodes x nproc_per_node;
global rank = node_rank x nproc_per_node + local_rank; on one node the rendezvous and the
workers' store are files in the launcher's private folder (nothing listens for them).
"""

from __future__ import annotations

import os
from typing import Any

from ..config import RunConfig
from ..environments import network
from ..errors import DdpkitError
from ..runtime.devices import check_gpu_count, cuda_device_count
from ..util.jobtoken import has_job_token, token_source
from .elastic import LaunchPlan, start_method_for

DEFAULT_MASTER_PORT = 29500


def make_launch_plan(cfg: RunConfig, nproc: int, device_type: str, clean_parent: bool, threads: int) -> LaunchPlan:
    lo, hi = cfg.node_range
    check_process_count(nproc, nproc * hi)
    common: dict[str, Any] = dict(
        nproc_per_node=nproc,
        nnodes=cfg.nnodes,
        max_restarts=cfg.max_restarts,
        start_method=start_method_for(cfg.start_method, device_type, clean_parent),
        timeout=cfg.timeout,
        threads_per_process=threads,
        debug_collectives=cfg.debug_collectives,
        monitor_interval=cfg.monitor_interval,
        log_dir=cfg.log_dir,
        redirects=cfg.redirects,
        tee=cfg.tee or "0",
        local_ranks_filter=cfg.local_ranks_filter,
    )
    plan = _make_plan(cfg, common, lo, hi)
    if plan.rdzv_backend == "static" and has_job_token():
        raise DdpkitError(
            "a job token seals a c10d rendezvous: with --master-addr (static) the agents' store is not sealed; "
            "use --rdzv-endpoint HOST:PORT on every node"
        )
    for key, value in cfg.rdzv_settings().items():  # --rdzv-conf: the user's c10d settings win
        plan.rdzv_configs[key] = (
            value.lower() in ("1", "true", "yes") if key == "is_host" else (int(value) if value.isdigit() else value)
        )
    return plan


FILES_PER_PEER = 3  # open files a process holds per process of the job (measured: pipes, logs, gloo's mesh)
FILES_BASE = 64


def check_process_count(nproc: int, world: int) -> None:
    """Refuse, before anything starts, a process count this machine cannot start: the launcher
    and every worker hold a few open files per process of the job (the launcher's pipes and
    logs of each worker, a worker's connection to every other), bounded by `ulimit -n`; and
    each process needs memory of its own (measured: ~22 MiB private even when forked from a
    launcher that imported torch, ~220 MiB when spawned)."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    need = FILES_PER_PEER * world + FILES_BASE
    if soft != resource.RLIM_INFINITY and need > soft:
        most = max(1, (soft - FILES_BASE) // FILES_PER_PEER)
        raise DdpkitError(
            f"--nproc {nproc}: a job of {world} processes needs about {need:,} open files per process and this shell "
            f"allows {soft:,} (ulimit -n): at most {most:,} processes here; raise the limit or use fewer"
        )
    available = _available_memory()
    if available is not None and nproc * WORKER_BYTES > available:
        raise DdpkitError(
            f"--nproc {nproc}: {nproc} worker processes need at least {nproc * WORKER_BYTES / 2**30:.1f} GiB "
            f"(~{WORKER_BYTES >> 20} MiB each, even forked) and this machine has "
            f"{available / 2**30:.1f} GiB available: use at most {max(1, available // WORKER_BYTES)}"
        )


WORKER_BYTES = 20 << 20  # the least a training worker holds of its own


def _available_memory() -> int | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _make_plan(cfg: RunConfig, common: dict[str, Any], lo: int, hi: int) -> LaunchPlan:
    if cfg.rdzv_id:
        common["rdzv_id"] = cfg.rdzv_id
    elif cfg.multi_node or cfg.rdzv_endpoint:
        # every node must name the same job: derive it from the rendezvous address
        where = cfg.rdzv_endpoint or f"{cfg.master_addr}:{cfg.master_port or DEFAULT_MASTER_PORT}"
        common["rdzv_id"] = "ddpkit-" + "".join(ch if ch.isalnum() else "-" for ch in where)
    if not cfg.multi_node and not cfg.rdzv_endpoint:
        return LaunchPlan(**common, rdzv_backend="c10d", rdzv_endpoint="", local_addr="127.0.0.1")
    if cfg.rdzv_endpoint:
        host, _, port = cfg.rdzv_endpoint.rpartition(":")
        target = network.resolve(host.strip("[]"))
        local = cfg.local_addr or network.source_address_for(target)
        rdzv: dict[str, Any] = {"is_host": network.is_local_address(target)}
        if lo < hi:
            # elastic: a survivor's next round starts once the lost node's keep-alive has expired
            # (interval x attempts: ~5 s), then waits last_call for more nodes (a joining one
            # polls every second): back to training within seconds of a node loss. A node whose
            # agent sends no keep-alive for (attempts - 1) x interval (an overloaded node: 4 s) is
            # declared dead too; 1 s x 5 tolerates twice the stall of 1 s x 3 for ~1.5 s more
            # recovery (2 s x 3 tolerates as much for ~3 s more; README, Reliability)
            rdzv.update(keep_alive_interval=1, keep_alive_max_attempt=5, last_call_timeout=2)
        return LaunchPlan(
            **common,
            rdzv_backend="c10d",
            rdzv_endpoint=f"{target}:{port}",
            local_addr=local,
            rdzv_configs=rdzv,
            extra_env=_gloo_env(local),
        )
    target = network.resolve(cfg.master_addr or "127.0.0.1")
    port = cfg.master_port or DEFAULT_MASTER_PORT
    local = cfg.local_addr or network.source_address_for(target)
    return LaunchPlan(
        **common,
        rdzv_backend="static",
        rdzv_endpoint=f"{target}:{port}",
        node_rank=cfg.node_rank,
        local_addr=local,
        extra_env=_gloo_env(local),
    )


def _gloo_env(local_addr: str) -> dict[str, str]:
    """gloo binds to whatever the host name resolves to (often 127.0.0.1, unreachable from
    other nodes). Point it at the interface that holds this node's address."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return {}
    name = network.interface_of(local_addr)
    return {"GLOO_SOCKET_IFNAME": name} if name and name != "lo" else {}


def describe(plan: LaunchPlan, backend: str, device_type: str) -> str:
    """The --dry-run report: what would start where; nothing is started."""
    lo, hi = plan.min_nodes, plan.max_nodes
    nodes = f"{lo}" if lo == hi else f"{lo}..{hi} (elastic)"
    world = f"{lo * plan.nproc_per_node}" if lo == hi else f"{lo * plan.nproc_per_node}..{hi * plan.nproc_per_node}"
    endpoint = plan.rdzv_endpoint if not plan.rdzv_endpoint.endswith(":0") else plan.rdzv_endpoint[:-2] + ":<free port>"
    if plan.local:
        endpoint = "this node only (a file store in a private folder)"
    if plan.node_rank is not None:
        this_node = f"node rank {plan.node_rank}"
    else:
        this_node = "node rank 0" if hi == 1 else "node rank assigned at rendezvous"
    lines = [
        "ddpkit: launch plan (dry run: nothing started)",
        f"  nodes              {nodes}",
        f"  processes per node {plan.nproc_per_node}",
        f"  world size         {world}",
        f"  rendezvous         {plan.rdzv_backend}{' at' if not plan.local else ','} {endpoint}"
        + (" (this node hosts it)" if plan.rdzv_configs.get("is_host") and plan.rdzv_backend == "c10d" else ""),
        f"  master             {_master(plan)}",
        f"  this node          {this_node}, address {plan.local_addr}",
        f"  backend / device   {backend} / {device_type}",
        f"  threads/process    {plan.threads_per_process}",
        f"  start method       {plan.start_method}, max restarts {plan.max_restarts}",
    ]
    if not plan.local:
        lines.append(f"  job token          {token_source() or 'none: the stores serve anyone who reaches them'}")
    if plan.tee != "0" or plan.redirects != "0" or plan.log_dir:
        shown = f" (local ranks {plan.local_ranks_filter})" if plan.local_ranks_filter else ""
        lines.append(
            f"  output             tee {plan.tee}{shown}, redirects {plan.redirects}, lines prefixed with the rank, "
            f"logs in {plan.log_dir or 'a temporary folder'}"
        )
    for k, v in plan.extra_env.items():
        lines.append(f"  environment        {k}={v}")
    lines.append("  local processes:")
    for local_rank in range(plan.nproc_per_node):
        if plan.node_rank is not None or hi == 1:
            node = plan.node_rank or 0
            rank = str(node * plan.nproc_per_node + local_rank)
        else:
            rank = f"node_rank x {plan.nproc_per_node} + {local_rank}"
        device = f"cuda:{local_rank}" if device_type == "cuda" else "cpu"
        lines.append(f"    local rank {local_rank} -> global rank {rank}, {device}")
    return "\n".join(lines)


def _master(plan: LaunchPlan) -> str:
    if plan.rdzv_backend == "static":
        host, _, port = plan.rdzv_endpoint.rpartition(":")
        return f"{host}:{port} (node 0)"
    if plan.local:
        return "this node (the workers' store: a file store in a private folder)"
    if plan.max_nodes == 1:
        return "127.0.0.1:<free port picked at start>"
    return "global rank 0's node, free port, published through the rendezvous"


def resolve_nproc(nproc: int | None, device_type: str) -> int:
    """'auto': one process per visible GPU; on CPU, 2 processes (so DDP really runs)."""
    if device_type == "cuda":
        ngpu = cuda_device_count()
        if nproc is None:
            return ngpu
        check_gpu_count(nproc, ngpu)  # DDPKIT_SHARE_GPU=1 lets ranks share them (runtime/devices.py)
        return nproc
    return 2 if nproc is None else nproc
