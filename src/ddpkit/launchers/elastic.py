"""Start workers on this node with torch's own elastic agent (what torchrun runs).

Rendezvous is c10d on a port the OS picks (never a fixed 12355), with the rendezvous store
kept apart from the workers' store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): in torch 2.13
that is the configuration in which restarts after a worker failure work.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..config import DEFAULT_TIMEOUT_S, ERROR_DIR_VAR
from ..errors import DdpkitError


@dataclass
class LaunchPlan:
    """Where the workers of this node go and how they meet."""

    nproc_per_node: int
    nnodes: str = "1"  # "N" or "MIN:MAX"
    node_rank: int | None = None  # static rendezvous only
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = "127.0.0.1:0"
    rdzv_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    rdzv_configs: dict[str, Any] = field(default_factory=dict)
    local_addr: str | None = "127.0.0.1"
    max_restarts: int = 0
    start_method: str = "spawn"
    timeout: float = DEFAULT_TIMEOUT_S
    threads_per_process: int = 1
    extra_env: dict[str, str] = field(default_factory=dict)
    debug_collectives: bool = False

    @property
    def min_nodes(self) -> int:
        return int(self.nnodes.split(":")[0])

    @property
    def max_nodes(self) -> int:
        return int(self.nnodes.split(":")[-1])


def run_elastic(plan: LaunchPlan, entrypoint: Callable[..., Any] | str, args: list[Any], env: dict[str, str] | None = None,
                verbose: bool = False, hang_dir: Path | None = None) -> dict[int, Any]:
    """Run `entrypoint(*args)` (a function, or an executable path) in nproc workers.
    Returns each local rank's return value. A worker's DdpkitError becomes ours; any other
    failure becomes a DdpkitError that names the rank and exit code. Workers never outlive
    this call: the agent stops the whole group when one fails or on SIGINT/SIGTERM.
    `hang_dir`: where the workers write hang reports (runtime/watchdog.py); when the job
    failed and they wrote one, its summary is printed before the error."""
    import time

    started = time.time()
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    scratch = Path(tempfile.mkdtemp(prefix="ddpkit-"))
    errors = scratch / "errors"
    errors.mkdir()
    saved_env = dict(os.environ)
    os.environ.update(plan.extra_env)
    os.environ.update(env or {})
    os.environ[ERROR_DIR_VAR] = str(errors)
    if plan.rdzv_backend == "c10d":
        # Workers get a store of their own: with the shared one, restarted workers read stale
        # addresses (pytorch/pytorch#135712). Static rendezvous serves workers from its store.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    os.environ["OMP_NUM_THREADS"] = str(plan.threads_per_process)
    if plan.debug_collectives:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"  # ranks check that their collectives match
    rdzv_configs = {"join_timeout": int(plan.timeout), **plan.rdzv_configs}
    endpoint, rdzv_store = plan.rdzv_endpoint, None
    if plan.rdzv_backend == "c10d" and plan.rdzv_configs.get("is_host"):
        endpoint, rdzv_store = _host_rendezvous_store(plan.rdzv_endpoint, plan.timeout)
    if plan.rdzv_backend == "static":
        rdzv_configs["rank"] = plan.node_rank
    config = LaunchConfig(
        min_nodes=plan.min_nodes,
        max_nodes=plan.max_nodes,
        nproc_per_node=plan.nproc_per_node,
        run_id=plan.rdzv_id,
        rdzv_backend=plan.rdzv_backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
        rdzv_timeout=int(plan.timeout),
        max_restarts=plan.max_restarts,
        monitor_interval=0.1,
        start_method=plan.start_method,
        logs_specs=DefaultLogsSpecs(log_dir=str(scratch / "logs"), redirects=Std.NONE, tee=Std.NONE),
        local_addr=plan.local_addr,
    )
    # The agent logs every failure with a traceback at ERROR level; ddpkit reports failures
    # itself (one line, plus the failing rank's own traceback), so keep the agent quiet.
    agent_logs = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.multiprocessing")]
    saved_levels = [log.level for log in agent_logs]
    if not verbose:
        for log in agent_logs:
            log.setLevel(logging.CRITICAL)
    try:
        return elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as e:
        if hang_dir is not None:
            print_hang_summary(hang_dir, since=started)
        raise DdpkitError(_failure_message(e, errors)) from None
    except SignalException as e:
        raise DdpkitError(f"stopped by {signal.Signals(e.sigval).name}; the workers were stopped (with --save-on-signal "
                          "they saved a checkpoint first: continue with --resume)") from None
    finally:
        del rdzv_store
        for log, level in zip(agent_logs, saved_levels):
            log.setLevel(level)
        os.environ.clear()
        os.environ.update(saved_env)
        shutil.rmtree(scratch, ignore_errors=True)


def print_hang_summary(hang_dir: Path, since: float) -> None:
    """The summary rank 0 wrote, or (rank 0 could not: stuck hard, or on another node) one made
    here from the reports this node can see; nothing when no report is newer than `since`."""
    from ..runtime.watchdog import format_summary

    request = hang_dir / "request"
    try:
        if request.stat().st_mtime < since - 1:
            return
    except OSError:
        return
    summary = hang_dir / "summary.txt"
    text = summary.read_text().rstrip() if summary.exists() else format_summary(hang_dir)
    print(text, file=sys.stderr, flush=True)


def _host_rendezvous_store(endpoint: str, timeout: float) -> tuple[str, Any]:
    """Serve the c10d rendezvous store on the endpoint's address only. torch's rendezvous
    opens its store with multi_tenant=True, so it reuses this server (bound to one address)
    instead of opening one on every interface."""
    from datetime import timedelta

    import torch.distributed as dist

    from ..runtime.store import bound_listener

    host, _, port = endpoint.rpartition(":")
    sock = bound_listener(host, int(port or 0))
    real_port = sock.getsockname()[1]
    store = dist.TCPStore(host, real_port, None, True, timedelta(seconds=timeout), wait_for_workers=False,
                          multi_tenant=True, master_listen_fd=sock.detach())
    return f"{host}:{real_port}", store


def _failure_message(e: Any, errors: Path) -> str:
    user_errors = sorted(errors.glob("rank-*.txt"), key=lambda p: int(p.stem.split("-")[1]))
    if user_errors:
        return user_errors[0].read_text().strip()
    rank, failure = e.get_first_failure()
    peer_losses = {int(p.stem.split("-")[1]): p for p in errors.glob("peer-*.txt")}
    if rank in peer_losses:
        # the first failure was a lost connection: the rank that died first is elsewhere
        return (peer_losses[rank].read_text().strip() + "; a process or node elsewhere in the job died "
                "(see that node's log); this node's workers were stopped")
    how = f"was killed by signal {-failure.exitcode}" if failure.exitcode < 0 else f"exited with code {failure.exitcode}"
    return f"worker rank {rank} {how}; the other workers were stopped (see its output above)"


def start_method_for(requested: str, device_type: str, clean_parent: bool) -> str:
    """fork is ~2 s faster per run (torch is already imported), but is only safe while the
    parent has touched neither CUDA nor OpenMP (a forked child inherits a broken thread
    pool). So 'auto' forks only for CPU runs from a parent known to be clean (the CLI);
    GPU runs and the Python API, called from anyone's process, spawn."""
    if requested != "auto":
        return requested
    return "fork" if clean_parent and device_type == "cpu" and sys.platform == "linux" else "spawn"
