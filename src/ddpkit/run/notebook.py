"""Training from a running Jupyter kernel on N local processes: `ddpkit.notebook_launch`.

A function defined in a notebook lives in the kernel's `__main__` and cannot be pickled for
spawned workers, so the workers are forked from the kernel. A fork inherits the kernel's
state, so what a forked worker cannot use is refused first, clearly: a process group up in
the kernel, CUDA initialised, torch's CPU thread pool started (a forked child's first
parallel op waits forever on threads that were not forked: a forked probe finds out).

Output: the workers write to their real file descriptors, which torch's agent tees, line by
line and prefixed with the rank, into the kernel's stdout and stderr: the notebook shows
them. A worker's exception is raised in the kernel as a DdpkitError naming the rank, the
exception and its message (its traceback is in the output above; a Task's: a WorkerFailed
saying the same); the ranks that another's failure stopped say nothing of it. Rank 0's
return value is returned.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import traceback
from typing import Any, Callable, Iterator

from ..config import RunConfig
from ..errors import DdpkitError
from ..task import Task
from ..util.envvars import ERROR_DIR_VAR, error_file


def notebook_launch(
    fn: Callable[..., Any] | Task,
    *args: Any,
    nproc: int = 2,
    kwargs: dict[str, Any] | None = None,
    **settings: Any,
) -> Any:
    """Run `fn(*args, **kwargs)` on `nproc` local processes forked from this kernel and return
    rank 0's value. In `fn`, `ddpkit.init()` joins the job, as in a script under `ddpkit
    launch`. A `ddpkit.Task` is trained as `ddpkit train` would (`settings`: RunConfig
    fields, e.g. epochs=3, batch_size=16) and its summary returned. For `fn`, `settings`
    are the process settings (threads, timeout, device, backend, verbose)."""
    from ..launchers.elastic import run_elastic
    from ..launchers.plan import make_launch_plan
    from ..launchers.report import FROM_START, RESUME_TRAIN
    from ..runtime import default_threads, resolve_device_type
    from .train import prepare_local_run

    if nproc < 1:
        raise DdpkitError(f"nproc={nproc}: give 1 or more processes")
    unknown = sorted(set(settings) - set(RunConfig.__dataclass_fields__))
    if unknown:
        raise DdpkitError(
            f"notebook_launch: no setting {', '.join(unknown)}; the settings are RunConfig's (epochs, batch_size, "
            "threads, ...); arguments of the function go positionally or in kwargs={...}"
        )
    if not (isinstance(fn, Task) or callable(fn)):
        raise DdpkitError(f"notebook_launch takes a function or a ddpkit.Task, got {type(fn).__name__}")
    check_forkable()
    cfg = RunConfig(**{"task": "notebook", **settings}).replace(nproc=nproc, start_method="fork", tee="3")
    device_type = resolve_device_type(cfg.device)
    plan = make_launch_plan(cfg, nproc, device_type, True, cfg.threads or default_threads(nproc))
    restarted = FROM_START  # what the workers do after a restart (--max-restarts)
    if isinstance(fn, Task):
        cfg = prepare_local_run(cfg)
        entry, entry_args, restarted = _train_task, [cfg.as_dict(), fn], RESUME_TRAIN
    else:
        entry, entry_args = _call, [fn, args, kwargs or {}]
    # Garbage an earlier launch left in the kernel (its objects in reference cycles, some holding
    # a store's or a process group's threads) is freed here, where those threads run: a forked
    # worker's first collection would free it where they do not, and abort (seen after a launch
    # that failed: `terminate called after throwing ... std::system_error`, the worker killed by SIGABRT).
    gc.collect()
    with _streams_for_fork():
        results = run_elastic(plan, entry, entry_args, verbose=cfg.verbose, restarted=restarted)
    return results.get(0) if isinstance(results, dict) else results[0]


def check_forkable() -> None:
    """Refuse, before forking, what a forked worker would inherit broken."""
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise DdpkitError(
            "a process group is up in this kernel (torch.distributed.init_process_group ran here): the "
            "workers would inherit it; destroy it (torch.distributed.destroy_process_group()) or restart the kernel"
        )
    if torch.cuda.is_initialized():
        raise DdpkitError(
            "CUDA is initialised in this kernel: forked workers cannot use it. Restart the kernel and call "
            "notebook_launch before any CUDA operation (build the model on the GPU inside the function)"
        )
    if not fork_runs_torch():
        raise DdpkitError(
            "torch's CPU thread pool is running in this kernel (a parallel torch operation ran here): a forked "
            "worker hangs in it. Restart the kernel and call torch.set_num_threads(1) before any torch "
            "operation, or do the torch work inside the launched function"
        )


def fork_runs_torch(timeout: float = 10.0) -> bool:
    """Does a child forked from this process finish a parallel torch op? Not when an OpenMP
    pool started here: the child waits forever on threads a fork does not copy. Asked of a
    real fork, since no API says whether the pool has started; the child is killed when it hangs."""
    import signal
    import time

    import torch

    pid = os.fork()
    if pid == 0:  # the child: one op split over the thread pool (above torch's grain size), then out
        try:
            torch.ones(1 << 18).mul_(2).sum()
        finally:
            os._exit(0)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return True
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return False


class _ForkedStream:
    """sys.stdout / sys.stderr while workers are forked: in this process it writes to what
    the kernel had (the notebook's stream, where torch's agent tees the workers' lines); in a
    forked worker, to the real file descriptor torch redirects into its log."""

    def __init__(self, kernel: Any, real: Any) -> None:
        self.kernel, self.real, self.pid = kernel, real, os.getpid()

    def _target(self) -> Any:
        return self.kernel if os.getpid() == self.pid else self.real

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def fileno(self) -> int:
        return self.real.fileno()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(), name)


@contextlib.contextmanager
def _streams_for_fork() -> Iterator[None]:
    kernel_out, kernel_err = sys.stdout, sys.stderr
    real_out = sys.__stdout__ or open(os.devnull, "w")  # noqa: SIM115 - lives as long as the kernel
    real_err = sys.__stderr__ or open(os.devnull, "w")  # noqa: SIM115
    sys.stdout, sys.stderr = _ForkedStream(kernel_out, real_out), _ForkedStream(kernel_err, real_err)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = kernel_out, kernel_err


def _call(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """In every worker: the user's function; its exception becomes the one line the kernel raises."""
    from .worker import another_rank_failed, die_with_parent, exception_line

    die_with_parent()
    rank = int(os.environ.get("RANK", "0"))
    try:
        return fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - every failure of the user's function is reported by rank
        error_dir = os.environ.get(ERROR_DIR_VAR)
        consequence = another_rank_failed(e)
        if consequence:  # another rank failed first (this one lost it, or the agent is stopping us): name that one
            if error_dir and consequence == "peer":
                error_file(error_dir, f"peer-{rank}.txt").write_text(f"rank {rank} lost contact with another rank")
            os._exit(1)
        traceback.print_exc()
        sys.stderr.flush()
        if error_dir:
            error_file(error_dir, f"rank-{rank}.txt").write_text(f"rank {rank} raised {exception_line(e)}")
        sys.exit(2)


def _train_task(config: dict[str, Any], task: Task) -> dict[str, Any]:
    from .worker import train_worker

    return train_worker(config, task)
