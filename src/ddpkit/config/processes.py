"""How many worker processes, how they start, wait and report: torchrun's flags for them, same
spellings and meaning (launchers/elastic.py), and --timeout, the wait any collective may take."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import DdpkitError
from ..storage.location import is_url
from .settings import FAULT_HANDLING, PROCESSES, Section, choice, positive, setting
from .values import parse_nproc

START_METHODS = ("auto", "fork", "spawn", "forkserver")
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Processes(Section):
    """The workers of this node: how many, how they start, how long a wait may take, what they print."""

    GROUP = PROCESSES

    nproc: int | None = setting(
        None,
        "worker processes on this node",
        group=PROCESSES,
        aliases=("--nproc-per-node", "--nproc_per_node"),
        metavar="N|auto",
        type=parse_nproc,
        default_help="auto: one per GPU; 2 on a machine without GPUs",
    )
    max_restarts: int = setting(
        0,
        "restart all workers this many times after a failure (train: they resume from the newest "
        "checkpoint; launch: the script starts again from its beginning, continuing only from a "
        "checkpoint it loads itself); a line says so at each restart",
        group=PROCESSES,
        help_group=FAULT_HANDLING,
        aliases=("--max_restarts",),
    )
    threads: int | None = setting(
        None, "CPU threads per process", group=PROCESSES, type=int, default_help="cores / processes"
    )
    start_method: str = setting(
        "auto",
        "how workers are created: fork (fast, CPU only) or spawn",
        group=PROCESSES,
        choices=START_METHODS,
        default_help="auto: fork on CPU, spawn with GPUs",
        aliases=("--start_method",),
    )
    timeout: float = setting(
        DEFAULT_TIMEOUT_S,
        "seconds any collective or rendezvous may wait before the job fails instead of hanging "
        "(launch: the default timeout of the script's own process group; one the script passes "
        "to init_process_group itself stands)",
        group=PROCESSES,
    )
    debug_collectives: bool = setting(
        False,
        "check across ranks that every collective matches (op, shapes, order) and name the rank that diverged (slow)",
        group=PROCESSES,
    )
    verbose: bool = setting(
        False,
        "show the elastic agent's own logs (rendezvous, restarts, failures); under train also what "
        "the task prints on every rank, whole lines, [rankN]: before those of ranks other than 0 "
        "(without it only rank 0's)",
        group=PROCESSES,
    )
    # torchrun's output and agent flags, same spellings and meaning (launchers/elastic.py)
    monitor_interval: float = setting(
        0.1, "seconds between the agent's checks of its workers", group=PROCESSES, aliases=("--monitor_interval",)
    )
    log_dir: str | None = setting(
        None,
        "keep every worker's stdout/stderr in files under this folder (LOG_DIR/RUN_ID/attempt_N/LOCAL_RANK/stdout.log)",
        group=PROCESSES,
        type=str,
        aliases=("--log_dir",),
    )
    redirects: str = setting(
        "0",
        "send workers' streams to log files only: 0 none, 1 stdout, 2 stderr, 3 both, or per local rank 0:3,1:0",
        group=PROCESSES,
        aliases=("-r",),
    )
    tee: str = setting(
        "",
        "streams written to log files and to the console, each line prefixed with its rank: 0-3 as --redirects",
        group=PROCESSES,
        aliases=("-t",),
        default_help="ddpkit launch: 3 with several local processes (lines never interleave), else 0",
    )
    local_ranks_filter: str = setting(
        "",
        "show only these local ranks' teed lines on the console, e.g. 0 or 0,1",
        group=PROCESSES,
        aliases=("--local_ranks_filter",),
        metavar="RANKS",
    )

    def check(self) -> None:
        if self.nproc is not None and (not isinstance(self.nproc, int) or self.nproc < 1):
            raise DdpkitError(f"--nproc must be a positive integer or 'auto', got {self.nproc!r}")
        if not self.timeout > 0:
            raise DdpkitError(f"--timeout must be a positive number of seconds, got {self.timeout}")
        if self.threads is not None:
            positive("--threads", self.threads)
        if self.max_restarts < 0:
            raise DdpkitError(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        choice("--start-method", self.start_method, START_METHODS)
        for flag, value in (("--redirects", self.redirects), ("--tee", self.tee or "0")):
            if not re.fullmatch(r"[0-3]|\d+:[0-3](,\d+:[0-3])*", value):
                raise DdpkitError(
                    f"{flag} must be 0-3 (0 none, 1 stdout, 2 stderr, 3 both) or LOCAL_RANK:N,..., got {value!r}"
                )
        if self.local_ranks_filter and not re.fullmatch(r"\d+(,\d+)*", self.local_ranks_filter):
            raise DdpkitError(
                "--local-ranks-filter must be local ranks separated by commas, e.g. 0,1; "
                f"got {self.local_ranks_filter!r}"
            )
        if is_url(self.log_dir):  # Path() would make s3://b/x a local folder 's3:'
            raise DdpkitError(
                f"--log-dir {self.log_dir}: torch's agent writes the workers' log files into a folder of this "
                "machine: give a local or shared folder (a run stored in a bucket takes --run-dir URL)"
            )
        if not (isinstance(self.monitor_interval, (int, float)) and self.monitor_interval > 0):
            raise DdpkitError(f"--monitor-interval must be a positive number of seconds, got {self.monitor_interval!r}")
