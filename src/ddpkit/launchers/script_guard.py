"""What `ddpkit launch` adds around a script that never imports ddpkit (bootstrap.py runs it).

  * --timeout becomes the default timeout of the script's process group: torch's default
    (30 minutes on gloo) is replaced when the script imports torch.distributed, so
    init_process_group and new_group without timeout= get it, and so does the rendezvous of
    init_process_group. A timeout the script passes itself stands: it asked for that one (a
    long first barrier while rank 0 prepares data); rank 0 says so in one line when it is longer
    than --timeout, and the hang watchdog still reports after --hang-timeout without progress.
  * the hang watchdog of `ddpkit train` (runtime/watchdog.py) once the group is up. Progress,
    observed without touching the script: a collective completed (torch's flight recorder
    counts every collective of the group, DDP's own included) or the main thread on another
    line of Python than a poll before (a rank computing, loading, logging). A rank blocked in a
    collective or asleep shows neither. A collective that times out in the script asks every
    rank for its report before the job is torn down.
  * every thread's Python stack on STACK_SIGNAL (faulthandler, into the attempt's error folder):
    the launcher asks for it from a rank whose watchdog thread cannot answer (stacks.py).
  * that the script returned (RETURNED_FILE): an abort in torch's teardown after that is named
    as such by the launcher, not as the script's failure. A worker whose script returned waits
    for the other workers of its node to return before the interpreter's teardown, so that such
    an abort cannot stop a rank still at work.
  * NCCL asked for on a machine without a GPU: one line before the group starts, not torch's
    error on every rank.
  * --debug-collectives under DDP (runtime/debug.py).
Nothing of torch is imported before the script imports it: the patches are applied by a
post-import hook on torch.distributed and by ddpkit's init_process_group, which calls torch's.
"""

from __future__ import annotations

import faulthandler
import functools
import inspect
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path
from typing import Any, Callable

from ..util.envvars import (
    ERROR_DIR_VAR,
    HANG_DIR_VAR,
    HANG_TIMEOUT_VAR,
    RETURNED_FILE,
    STACKS_FILE,
    TIMEOUT_VAR,
    error_file,
    ranks_with,
)

# asks a worker for every thread's stack: a real-time signal no library uses (USR1/USR2 are the
# schedulers' and --save-on-signal's); none where the system has no real-time signals
STACK_SIGNAL: int | None = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else None


class ScriptGuard:
    def __init__(
        self,
        timeout: float | None,
        hang_timeout: float | None,
        hang_dir: str | None,
        error_dir: str | None,
        rank: int,
    ) -> None:
        self.timeout = timeout  # --timeout: the group's default
        self.hang_timeout = hang_timeout  # --hang-timeout when given (else from the group's timeout)
        self.hang_dir = Path(hang_dir) if hang_dir else None
        self.error_dir = error_dir
        self.rank = rank
        self.watchdog: Any = None
        self._stacks: Any = None  # the open file faulthandler writes to
        self._main = threading.main_thread().ident

    @classmethod
    def from_environ(cls) -> ScriptGuard:
        def seconds(name: str) -> float | None:
            value = os.environ.get(name)
            return float(value) if value else None

        return cls(
            seconds(TIMEOUT_VAR),
            seconds(HANG_TIMEOUT_VAR),
            os.environ.get(HANG_DIR_VAR),
            os.environ.get(ERROR_DIR_VAR),
            int(os.environ.get("RANK", "0") or 0),
        )

    # -- before the script -------------------------------------------------------------------
    def install(self) -> None:
        # torch's flight recorder: the progress the watchdog sees, and each rank's last collectives in a report
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
        if self.error_dir and STACK_SIGNAL is not None:
            self._stacks = open(error_file(self.error_dir, STACKS_FILE.format(rank=self.rank)), "w")  # noqa: SIM115
            self._stacks.write(f"{os.getpid()} {self._main}\n")
            self._stacks.flush()
            faulthandler.register(STACK_SIGNAL, file=self._stacks, all_threads=True, chain=False)
        sys.meta_path.insert(0, _AfterImport("torch.distributed", self._patch_torch))

    def _patch_torch(self, dist: Any) -> None:
        """torch.distributed was just imported (inside the script's `import torch`)."""
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        if c10d is None:  # a torch without distributed support
            return
        if self.timeout:
            default = timedelta(seconds=self.timeout)
            constants = sys.modules["torch.distributed.constants"]
            for module in (c10d, constants):
                module.default_pg_timeout = default
                if getattr(module, "default_pg_nccl_timeout", None) is not None:
                    module.default_pg_nccl_timeout = default
        init, destroy = self._wrap(c10d.init_process_group), self._wrap_destroy(c10d.destroy_process_group)
        c10d.init_process_group = dist.init_process_group = init
        c10d.destroy_process_group = dist.destroy_process_group = destroy

    def _wrap(self, torch_init: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(torch_init)

        @functools.wraps(torch_init)
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            given = signature.bind_partial(*args, **kwargs).arguments
            self._before_group(given)
            result = torch_init(*args, **kwargs)
            self._after_group(given)
            return result

        return init_process_group

    def _wrap_destroy(self, torch_destroy: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(torch_destroy)
        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group", args[0] if args else None)
            if group is None and self.watchdog is not None:  # the default group: no collective can hang now
                in_flight = sys.exc_info()[1]  # torn down as an error unwinds (a `with ddpkit.init()` block)
                if in_flight is not None:
                    self.failed(in_flight)  # a collective that timed out: every rank's report first
                else:
                    self.watchdog.stop()
                self.watchdog = None
            return torch_destroy(*args, **kwargs)

        return destroy_process_group

    def _before_group(self, given: dict[str, Any]) -> None:
        import torch

        from ..runtime.debug import apply_debug_level

        apply_debug_level()
        backend = str(given.get("backend") or "")
        if "nccl" in backend.lower() and "gloo" not in backend.lower() and not torch.cuda.is_available():
            self._refuse(
                f"the script asks init_process_group for backend {backend!r}, which needs a CUDA GPU, and this "
                "machine has none: use backend 'gloo' (the script's own setting) to run it on CPUs"
            )

    def _after_group(self, given: dict[str, Any]) -> None:
        import torch.distributed as dist

        asked = given.get("timeout")
        nccl = "nccl" in str(dist.get_backend()).lower()
        default = dist.distributed_c10d.default_pg_nccl_timeout if nccl else dist.distributed_c10d.default_pg_timeout
        group_timeout = (asked if isinstance(asked, timedelta) else default or timedelta(minutes=30)).total_seconds()
        if self.hang_timeout is not None:
            hang = self.hang_timeout
        else:  # torch aborts a process whose NCCL collective passes its timeout: report first
            hang = (0.9 if nccl else 2.0) * group_timeout
        rank, world = dist.get_rank(), dist.get_world_size()
        if rank == 0 and self.timeout and group_timeout > self.timeout:
            watch = f"a hang is reported after {hang:g} s without progress" if hang else "the hang watchdog is off"
            print(
                f"ddpkit: the script sets its process group's timeout to {group_timeout:g} s, longer than "
                f"--timeout {self.timeout:g}: its own stands; {watch} (--hang-timeout)",
                file=sys.stderr,
                flush=True,
            )
        if world > 1 and self.hang_dir is not None:
            self._start_watchdog(rank, world, hang)

    def _start_watchdog(self, rank: int, world: int, hang: float) -> None:
        from ..runtime.record import CollectiveRecord
        from ..runtime.watchdog import HangWatchdog, fresh_hang_dir

        if rank == 0:
            fresh_hang_dir(self.hang_dir)  # a report of an earlier run in this folder moves aside
        if self.watchdog is not None:  # a group before this one
            self.watchdog.stop()
        self.rank = rank
        self.watchdog = HangWatchdog(
            self.hang_dir,
            rank,
            world,
            hang,
            self.error_dir,
            launcher_prints=bool(self.error_dir),
            record=CollectiveRecord(),
            progress=self._progress,
        ).start()

    def _progress(self) -> Any:
        """What changes while this rank gets on: its completed collectives, its main thread's line."""
        from ..runtime.watchdog import fr_progress

        counts = fr_progress()
        frame = sys._current_frames().get(self._main)
        return (counts[0] if counts else None, (id(frame.f_code), frame.f_lineno) if frame is not None else None)

    def _refuse(self, message: str) -> None:
        """One line for the launcher (the first rank's is printed), and this worker ends (exit 2)."""
        if self.error_dir:
            error_file(self.error_dir, f"rank-{self.rank}.txt").write_text(message)
        else:
            print(f"ddpkit: error: {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(2)

    # -- after the script --------------------------------------------------------------------
    def returned(self) -> None:
        """The script ran to its end: what fails after this is the interpreter's or torch's teardown."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.error_dir:
            error_file(self.error_dir, RETURNED_FILE.format(rank=self.rank)).touch()
            self._wait_for_the_others()

    def _wait_for_the_others(self, poll: float = 0.2) -> None:
        """Until every other worker of this node has returned too, or ended: torch's teardown can
        abort a process after its script returned ("terminate called without an active
        exception"), and the agent stops the whole group at the first failed worker: a rank that
        finished first would cut off one still at work (rank 0 saving the final checkpoint). After
        this wait such an abort finds every script returned, and the launcher counts the job done."""
        folder = error_file(self.error_dir or "", RETURNED_FILE.format(rank=self.rank)).parent
        while True:
            working = ranks_with(folder, STACKS_FILE) - ranks_with(folder, RETURNED_FILE) - {self.rank}
            if not any(_alive(folder / STACKS_FILE.format(rank=rank)) for rank in working):
                return
            time.sleep(poll)

    def failed(self, error: BaseException) -> None:
        """The script raised `error`: a collective that timed out gets every rank's report first."""
        if self.watchdog is None:
            return
        from ..runtime.watchdog import is_timeout

        if isinstance(error, RuntimeError) and is_timeout(error):  # torch's DistError and gloo's are RuntimeErrors
            self.watchdog.on_error(error)
        self.watchdog.stop()


def _alive(stacks_file: Path) -> bool:
    """Whether the worker that wrote `stacks_file` (its pid on the first line) still runs."""
    try:
        pid = int(stacks_file.read_text().split()[0])
        os.kill(pid, 0)
    except (ValueError, IndexError, OSError):  # not written yet, or gone (reaped by the agent)
        return False
    return True


class _AfterImport(MetaPathFinder):
    """Calls `callback(module)` once, right after the module `name` has been imported."""

    def __init__(self, name: str, callback: Callable[[Any], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader, callback = spec.loader, self.callback
        torch_exec = loader.exec_module

        def exec_module(module: Any) -> None:
            torch_exec(module)
            callback(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
