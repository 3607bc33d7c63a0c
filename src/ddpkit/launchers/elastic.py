"""Start workers on this node with torch's own elastic agent (what torchrun runs).

Rendezvous is c10d, with the rendezvous store kept apart from the workers' store
(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): in torch 2.13 that is the configuration in which
restarts after a worker failure work. On one node both stores are files in this launcher's
private folder (0700: c10d's FileStore backend for the rendezvous, a FileStore per attempt for
the workers, runtime/store.py), so no other local user can read or rewrite them: torch's
TCPStore has no authentication and loopback is open to every user, and the rendezvous state
it would hold is pickled (rewriting it ran code in the agent). Across nodes the rendezvous is a
TCPStore on the endpoint's address, sealed with the job token when one is set (sealed_rdzv.py);
without one, a network the job trusts (README, Security).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from ..config.processes import DEFAULT_TIMEOUT_S
from ..errors import DdpkitError, Interrupted
from ..training.signals import stopped_note
from ..util.envvars import AGENT_PID_VAR, AGENT_START_VAR, ERROR_DIR_VAR, SNAPSHOT_DIR_VAR, STORE_FILE_VAR
from . import sealed_rdzv
from .joined import NEVER_JOINED, JoinWatch
from .report import FROM_START, RestartLine, job_failure, rendezvous_message, restarts_announced
from .scope import scoped_environ, signal_handlers_kept, whole_line_tail
from .stacks import StackCollector


@dataclass
class LaunchPlan:
    """Where the workers of this node go and how they meet."""

    nproc_per_node: int
    nnodes: str = "1"  # "N" or "MIN:MAX"
    node_rank: int | None = None  # static rendezvous only
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = ""  # c10d without an endpoint: this node only, through private files (`local`)
    rdzv_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    rdzv_configs: dict[str, Any] = field(default_factory=dict)
    local_addr: str | None = "127.0.0.1"
    max_restarts: int = 0
    start_method: str = "spawn"
    timeout: float = DEFAULT_TIMEOUT_S
    threads_per_process: int = 1
    extra_env: dict[str, str] = field(default_factory=dict)
    debug_collectives: bool = False
    # torchrun's output flags: where workers' streams go (log files, console with a rank prefix)
    monitor_interval: float = 0.1
    log_dir: str | None = None
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: str = ""

    @property
    def local(self) -> bool:
        """One node, nobody to meet over the network: the stores are files in a private folder."""
        return self.rdzv_backend == "c10d" and not self.rdzv_endpoint and self.max_nodes == 1

    @property
    def min_nodes(self) -> int:
        return int(self.nnodes.split(":")[0])

    @property
    def max_nodes(self) -> int:
        return int(self.nnodes.split(":")[-1])


def run_elastic(
    plan: LaunchPlan,
    entrypoint: Callable[..., Any] | str,
    args: list[Any],
    env: dict[str, str] | None = None,
    verbose: bool = False,
    agent_options: dict[str, Any] | None = None,
    hang_dir: Path | None = None,
    restarted: str = FROM_START,
) -> dict[int, Any]:
    """Run `entrypoint(*args)` (a function, or an executable path) in nproc workers.
    Returns each local rank's return value. A worker's DdpkitError becomes ours; any other
    failure becomes a WorkerFailed that names the rank and exit code (launchers/report.py);
    SIGINT/SIGTERM an Interrupted. Workers never outlive this call: the agent stops the whole
    group when one fails or on a signal.
    `hang_dir`: where the workers write hang reports (runtime/watchdog.py); when the job
    failed and they wrote one, its summary is printed before the error, which names the rank
    that hung. `restarted`: what restarted workers do, said at each restart (--max-restarts).
    What this process changes for the launch (the environment the agent hands its workers,
    torch's log tail, the agent's log levels and class, the signal handlers it installs) is
    put back when it returns or raises."""
    from ..checkpoint.snapshot import new_agent_folder  # torch: imported by the launch anyway

    with contextlib.ExitStack() as scope:
        scratch = Path(tempfile.mkdtemp(prefix="ddpkit-"))  # 0700: only this user can enter it
        scope.callback(shutil.rmtree, scratch, ignore_errors=True)
        private = {STORE_FILE_VAR: str(scratch / "workers-store") if plan.local else ""}
        snapshots = new_agent_folder(plan.rdzv_id) if plan.max_restarts > 0 else None
        if snapshots is not None:  # the node's memory snapshots (checkpoint/snapshot.py)
            scope.callback(shutil.rmtree, snapshots, ignore_errors=True)
            private[SNAPSHOT_DIR_VAR] = str(snapshots)
        errors = scratch / "errors"
        errors.mkdir()
        environ = {**_launch_environ(plan, env, errors), **private}
        scope.enter_context(scoped_environ(environ, also=(*AGENT_SETS, SNAPSHOT_DIR_VAR, AGENT_START_VAR)))
        scope.enter_context(_agent_logs(verbose))
        scope.enter_context(whole_line_tail())
        scope.enter_context(signal_handlers_kept())
        scope.enter_context(restarts_announced(RestartLine(restarted, errors)))
        return _launch(plan, entrypoint, args, scratch, errors, agent_options, hang_dir)


# what torch's elastic_launch itself sets in the launching process's environment
AGENT_SETS = ("TORCHELASTIC_SIGNALS_TO_HANDLE",)


def _launch_environ(plan: LaunchPlan, env: dict[str, str] | None, errors: Path) -> dict[str, str]:
    """The variables the agent (which reads them here) and its workers (which inherit them) need."""
    out = {
        **plan.extra_env,
        **(env or {}),
        ERROR_DIR_VAR: str(errors),
        AGENT_PID_VAR: str(os.getpid()),  # the agent runs in this process
        "OMP_NUM_THREADS": str(plan.threads_per_process),
    }
    if plan.rdzv_backend == "c10d":
        # Workers get a store of their own: with the shared one, restarted workers read stale
        # addresses (pytorch/pytorch#135712). Static rendezvous serves workers from its store.
        out["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if plan.debug_collectives:
        out["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"  # ranks check that their collectives match
    return out


@contextlib.contextmanager
def _agent_logs(verbose: bool) -> Iterator[None]:
    """The agent logs every failure with a traceback at ERROR level; ddpkit reports failures
    itself (one line, plus the failing rank's own traceback), so keep the agent quiet."""
    import torch.distributed.launcher.api  # noqa: F401  (its modules' loggers exist from here on)

    # each module's logger has its own level (torch sets it from LOGLEVEL): a parent's is not enough
    prefixes = ("torch.distributed.elastic", "torch.multiprocessing")
    names = [n for n in logging.root.manager.loggerDict if n.startswith(prefixes)]
    agent_logs = [logging.getLogger(n) for n in sorted({*prefixes, *names})]
    saved_levels = [log.level for log in agent_logs]
    if not verbose:
        for log in agent_logs:
            log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for log, level in zip(agent_logs, saved_levels, strict=True):
            log.setLevel(level)


def _launch(
    plan: LaunchPlan,
    entrypoint: Callable[..., Any] | str,
    args: list[Any],
    scratch: Path,
    errors: Path,
    agent_options: dict[str, Any] | None,
    hang_dir: Path | None,
) -> dict[int, Any]:
    started = time.time()
    from torch.distributed import DistNetworkError, DistStoreError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )
    from torch.distributed.launcher.api import elastic_launch

    config, endpoint, rdzv_store = _launch_config(plan, scratch, agent_options)  # the store lives until we return
    if plan.start_method == "fork" and callable(entrypoint):
        entrypoint = prepared_to_fork(entrypoint, plan.nproc_per_node)
    # a script's workers (ddpkit train's join before any task code runs): did any join a process group?
    watch = JoinWatch().start() if isinstance(entrypoint, str) and plan.nproc_per_node * plan.max_nodes > 1 else None
    stacks = StackCollector(hang_dir, errors, started).start() if hang_dir is not None else None
    os.environ[AGENT_START_VAR] = repr(time.time())  # the workers' ledger splits their start-up at it
    try:
        results = elastic_launch(config, entrypoint)(*args)
        if watch is not None:
            watch.stop()
            if watch.never_joined():
                print(NEVER_JOINED.format(n=plan.nproc_per_node), file=sys.stderr, flush=True)
        return results
    except ChildFailedError as e:
        if stacks is not None:
            stacks.stop()  # what it asked a rank for is in the report before the report is read
        # torch's agent ends the job on a failure only once its restarts are spent: the failing
        # attempt is number max_restarts (restarts for a node joining or leaving are not counted)
        failure = job_failure(e, errors, plan.max_restarts, hang_dir, started)
        if failure is None:
            return {}  # every script had returned: what failed after was the teardown (said)
        raise failure from None
    except (
        RendezvousTimeoutError,
        RendezvousConnectionError,
        RendezvousClosedError,
        DistStoreError,
        DistNetworkError,
    ) as e:
        # the agent's own store (static rendezvous: node 0 serves it) never completing is a rendezvous failure too
        raise DdpkitError(rendezvous_message(e, plan, endpoint)) from None
    except SignalException as e:
        raise interrupted(e.sigval, errors) from None
    finally:
        if watch is not None:
            watch.stop()
        if stacks is not None:
            stacks.stop()
        del rdzv_store


def interrupted(signum: int, errors: Path) -> Interrupted:
    """This launcher was stopped by signal `signum`: by one it received (a pod evicted, Ctrl-C), or by
    its workers, who stopped at the step another node's signal made every rank stop at (their note
    in `errors` says so, and at which step they saved)."""
    name = signal.Signals(signum).name
    note = stopped_note(list(errors.glob("attempt-*"))) or {}
    said = f"stopped by {name}; the workers were stopped"
    if note.get("elsewhere") and note.get("signal") == name:
        said = f"stopped by {name}, which another node received; the workers here stopped with it"
    step = note.get("steps_done")
    return Interrupted(signum, said, step if isinstance(step, int) else None)


def _launch_config(plan: LaunchPlan, scratch: Path, agent_options: dict[str, Any] | None) -> tuple[Any, str, Any]:
    """torch's LaunchConfig for the plan, the rendezvous endpoint, and the rendezvous store
    this launcher hosts (None when torch's agent opens its own)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    rdzv_configs = {"join_timeout": int(plan.timeout), **plan.rdzv_configs}
    endpoint, rdzv_store = plan.rdzv_endpoint, None
    if plan.local:  # c10d's FileStore backend: the rendezvous state in this launcher's private folder
        endpoint = str(scratch / "rendezvous-store")
        rdzv_configs["store_type"] = "file"
        rdzv_configs.pop("is_host", None)
    elif plan.rdzv_backend == "c10d" and plan.rdzv_configs.get("is_host"):
        endpoint, rdzv_store = _host_rendezvous_store(plan.rdzv_endpoint, plan.timeout)
        if rdzv_store is None:  # another launcher on this host bound it first: join its store, as torchrun does
            rdzv_configs["is_host"] = False
        else:
            sealed_rdzv.mark_store(rdzv_store, plan.rdzv_id)
    backend = plan.rdzv_backend
    if plan.rdzv_backend == "c10d" and not plan.local:  # across nodes: sealed with the job token, when one is set
        backend = sealed_rdzv.register()
    if plan.rdzv_backend == "static":
        rdzv_configs["rank"] = plan.node_rank
    agent = _agent_config(agent_options or {})
    logs_specs_cls = agent.pop("logs_specs_cls", DefaultLogsSpecs)
    config = LaunchConfig(
        min_nodes=plan.min_nodes,
        max_nodes=plan.max_nodes,
        nproc_per_node=plan.nproc_per_node,
        run_id=plan.rdzv_id,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
        rdzv_timeout=int(plan.timeout),
        max_restarts=plan.max_restarts,
        monitor_interval=plan.monitor_interval,
        start_method=plan.start_method,
        logs_specs=logs_specs_cls(
            log_dir=plan.log_dir or str(scratch / "logs"),
            redirects=Std.from_str(plan.redirects),
            tee=Std.from_str(plan.tee or "0"),
            local_ranks_filter=_ranks(plan.local_ranks_filter),
        ),
        local_addr=plan.local_addr,
        # teed lines carry the global rank; torchrun's variable for the template is honoured
        log_line_prefix_template=os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}]:"),
        **agent,
    )
    return config, endpoint, rdzv_store


def _host_rendezvous_store(endpoint: str, timeout: float) -> tuple[str, Any]:
    """Serve the c10d rendezvous store on the endpoint's address only. torch's rendezvous
    opens its store with multi_tenant=True, so it reuses this server (bound to one address)
    instead of opening one on every interface. When another launcher on this host already
    serves it (several "nodes" on one machine), return (endpoint, None): join as a client."""
    from datetime import timedelta

    import torch.distributed as dist

    from ..runtime.store import bound_listener

    host, _, port = endpoint.rpartition(":")
    try:
        sock = bound_listener(host, int(port or 0))
    except DdpkitError:
        if int(port or 0) and _someone_listens(host, int(port)):
            return endpoint, None
        raise
    real_port = sock.getsockname()[1]
    store = dist.TCPStore(
        host,
        real_port,
        None,
        True,
        timedelta(seconds=timeout),
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=sock.detach(),
    )
    return f"{host}:{real_port}", store


def _agent_config(options: dict[str, Any]) -> dict[str, Any]:
    """torchrun's agent flags (cli.options.agent_options()) as LaunchConfig's fields, converted as torchrun does."""
    out = dict(options)
    for name in ("duplicate_stdout_filters", "duplicate_stderr_filters"):
        if name in out:
            out[name] = [f.replace("\0", ",") for f in out[name].replace(",,", "\0").split(",") if f]
    if "numa_binding" in out:
        from torch.numa.binding import AffinityMode, NumaOptions

        try:
            out["numa_options"] = NumaOptions(affinity_mode=AffinityMode(out.pop("numa_binding")))
        except ValueError as e:
            raise DdpkitError(f"--numa-binding: {e}") from None
    if "logs_specs" in out:
        from torch.distributed.run import _get_logs_specs_class

        try:
            out["logs_specs_cls"] = _get_logs_specs_class(out.pop("logs_specs"))
        except ValueError as e:
            raise DdpkitError(f"--logs-specs: {e}") from None
    return out


def _someone_listens(host: str, port: int) -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _ranks(text: str) -> set[int] | None:
    return {int(r) for r in text.split(",")} if text else None


def start_method_for(requested: str, device_type: str, clean_parent: bool) -> str:
    """fork is ~2 s faster per run (torch is already imported), but is only safe while the
    parent has touched neither CUDA nor OpenMP (a forked child inherits a broken thread
    pool). So 'auto' forks only for CPU runs from a parent known to be clean (the CLI);
    GPU runs and the Python API, called from anyone's process, spawn."""
    if requested != "auto":
        return requested
    return "fork" if clean_parent and device_type == "cpu" and sys.platform == "linux" else "spawn"


def prepared_to_fork(fn: Callable[..., Any], nproc: int) -> Callable[..., Any]:
    """`fn` as forked workers run it, with what they share imported once beforehand."""
    if nproc > 1:
        import_before_fork()
    return with_new_process_signals(fn)


def with_new_process_signals(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run in a forked worker with the signal handlers a new process has (what a spawned worker
    gets): torch's agent sets handlers that raise its SignalException before it starts the
    workers, and a forked worker inherits them. Its SIGTERM from the agent (another rank failed)
    then raised wherever the worker was, a weakref callback's 'Exception ignored in' traceback on
    the user's terminal included. SIGTERM ends a worker; Ctrl-C raises KeyboardInterrupt."""

    @functools.wraps(fn)
    def entry(*args: Any) -> Any:
        for name in ("SIGTERM", "SIGHUP", "SIGQUIT"):
            sig = getattr(signal, name, None)
            if sig is not None:
                signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        return fn(*args)

    return entry


def import_before_fork() -> None:
    """Import here, once, what every worker would otherwise import for itself: DDP's
    constructor and the first optimizer step load torch._dynamo (sympy, fx: ~1.5 s of CPU).
    Forked workers share the parent's modules, so N workers pay it once instead of N times,
    which on an oversubscribed node (32 workers on 2 cores) was ~35 s of the start of every
    job. The import starts no thread (measured: none), so the parent stays safe to fork."""
    import torch._dynamo  # noqa: F401
