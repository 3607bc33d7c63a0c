"""`ddpkit launch`: any script on N local workers, with the environment torchrun gives, every
torchrun flag accepted with torchrun's meaning."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass

from .. import config
from .flags import config_from
from .options import PLAN_ONLY, config_option, option
from .parser import Command

LAUNCH_HELP = """Run any script on N local worker processes, with the environment torchrun gives
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...). In the script,
`rt = ddpkit.init()` joins the job; the same script runs unchanged under torchrun. Every torchrun
flag is accepted with torchrun's meaning (also with underscores: --nproc_per_node, --rdzv_conf, ...);
with several local workers every output line is whole and prefixed with its rank (--tee 3). Each
worker runs the script as python would (same argv, __file__, sys.path[0]) through a small ddpkit
bootstrap: --timeout becomes the default timeout of the script's process group, and a hang
(--hang-timeout) ends the job with every rank's Python stack and the rank that hung named."""

AGENT = "torchrun's agent options (passed to torch's elastic agent as they are)"


@dataclass(frozen=True)
class LaunchOptions:
    dry_run: bool = option(False, PLAN_ONLY)
    config: str | None = config_option()
    module: bool = option(False, "run SCRIPT as a module (python -m SCRIPT)", flag="-m", aliases=("--module",))
    no_python: bool = option(
        False,
        "run SCRIPT as an executable itself, not through python (torchrun's --no-python)",
        aliases=("--no_python",),
    )
    run_path: bool = option(
        False,
        "run SCRIPT as a Python file path (torchrun's --run-path; what ddpkit does anyway)",
        aliases=("--run_path",),
    )
    # torchrun's flags for torch's elastic agent, passed on as they are (same spellings, types and
    # defaults as torch/distributed/run.py); None: torch's own default
    role: str | None = option(help="the workers' role name", group=AGENT)
    event_log_handler: str | None = option(
        help="torch's event log handler", group=AGENT, aliases=("--event_log_handler",)
    )
    signals_to_handle: str | None = option(
        help="signals the agent forwards to the workers (torch's default SIGTERM,SIGINT,SIGHUP,SIGQUIT)",
        group=AGENT,
        aliases=("--signals_to_handle",),
    )
    duplicate_stdout_filters: str | None = option(
        help="copy teed stdout lines matching any of these comma-separated filters to a file",
        group=AGENT,
        aliases=("--duplicate_stdout_filters",),
    )
    duplicate_stderr_filters: str | None = option(
        help="the same for stderr", group=AGENT, aliases=("--duplicate_stderr_filters",)
    )
    virtual_local_rank: bool = option(
        False, "every worker sees LOCAL_RANK=0 (and its own device)", group=AGENT, aliases=("--virtual_local_rank",)
    )
    shutdown_timeout: int | None = option(
        help="seconds the workers get to stop before SIGKILL (torch's default 30)",
        type=int,
        group=AGENT,
        aliases=("--shutdown_timeout",),
    )
    numa_binding: str | None = option(
        help="bind each worker to its GPU's NUMA node (torch's modes)", group=AGENT, aliases=("--numa_binding",)
    )
    logs_specs: str | None = option(
        help="a torchrun.logs_specs entry point instead of torch's DefaultLogsSpecs",
        group=AGENT,
        aliases=("--logs_specs",),
    )
    script: str | None = option(
        help="the script (or module with -m) to run in every worker", positional=True, nargs=None
    )
    args: list[str] | None = option(help="arguments passed to the script", positional=True, nargs=argparse.REMAINDER)


def agent_options(options: type = LaunchOptions) -> tuple[str, ...]:
    """The names of the settings ddpkit hands to torch's elastic agent unchanged."""
    return tuple(f.name for f in dataclasses.fields(options) if f.metadata["group"] == AGENT)


def cmd_launch(ns: argparse.Namespace) -> int:
    # The agent's store clients log every retry with a C++ stack (a static rendezvous whose node 0
    # never comes); ddpkit says what failed in one line. Quiet only in this process: the variable
    # is read once, when torch loads, and is gone before any worker starts (--verbose keeps them).
    quiet = not ns.verbose and "TORCH_CPP_LOG_LEVEL" not in os.environ and "torch" not in sys.modules
    if quiet:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        import torch  # noqa: F401
    finally:
        if quiet:
            del os.environ["TORCH_CPP_LOG_LEVEL"]
    from ..launchers.script import launch

    argv = (["-m", ns.script] if ns.module else [ns.script]) + list(ns.args)
    agent = {name: getattr(ns, name) for name in agent_options() if getattr(ns, name) not in (None, False)}
    return launch(argv, config_from(ns), dry_run=ns.dry_run, no_python=ns.no_python, agent_options=agent)


COMMAND = Command(
    cmd_launch,
    "run any script on N local workers (like torchrun)",
    LAUNCH_HELP,
    (config.PROCESSES, config.NODES),
    ("hang_timeout",),
    options=LaunchOptions,
    compact=True,
)
