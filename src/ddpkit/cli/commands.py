"""The command line's dispatch and exit codes: the table of commands, each declared in its own
module (cli/train_cmd.py, ...: its help, flags and handler; every handler calls the Python API),
and how a command ends (0, 1, 2, 128 + N after signal N)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any, Iterator, Sequence

from ..errors import DdpkitError, Terminated
from ..util.envvars import LAUNCH_TIME_VAR, SLOW_EXIT_VAR
from . import (
    bench_cmd,
    check_cmd,
    env_cmd,
    export_cmd,
    help_cmd,
    k8s_cmd,
    launch_cmd,
    plan_cmd,
    plot_cmd,
    ray_cmd,
    runs_cmd,
    sky_cmd,
    slurm_cmd,
    train_cmd,
    verify_cmd,
)
from . import parser as command_parser

# In the order `ddpkit --help` lists them: a new command is one module and one line here
COMMANDS = {
    "train": train_cmd.COMMAND,
    "plan": plan_cmd.COMMAND,
    "launch": launch_cmd.COMMAND,
    "slurm": slurm_cmd.COMMAND,
    "k8s": k8s_cmd.COMMAND,
    "ray": ray_cmd.COMMAND,
    "sky": sky_cmd.COMMAND,
    "env": env_cmd.COMMAND,
    "check": check_cmd.COMMAND,
    "verify": verify_cmd.COMMAND,
    "plot": plot_cmd.COMMAND,
    "export": export_cmd.COMMAND,
    "runs": runs_cmd.COMMAND,
    "bench": bench_cmd.COMMAND,
    "help": help_cmd.COMMAND,
}


def build_parser(file_settings: dict[str, Any] | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; `file_settings` (a --config file's) become the defaults of the flags,
    so a flag given on the command line wins over the file and a flag left out does not."""
    return command_parser.build_parser(COMMANDS, file_settings)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, with a --config file's settings as the defaults (parser.py)."""
    return command_parser.parse_args(COMMANDS, argv)


def main(argv: Sequence[str] | None = None) -> int:
    """The command's exit code, by the shell's convention: 0 done, 1 a failure (a worker's crash,
    a hang), 2 a usage error (a refusal of ddpkit's, one line), 128 + N after signal N (130 for
    Ctrl-C's SIGINT, 143 for SIGTERM)."""
    os.environ.setdefault(LAUNCH_TIME_VAR, repr(time.time()))
    with terminated_as_interrupt(argv is None):
        parser = build_parser()
        ns = parser.parse_args(argv)
        if ns.command is None:
            parser.print_help()
            return 2
        try:
            if getattr(ns, "config", None):
                ns = parse_args(argv)
            code = COMMANDS[ns.command].run(ns)
        except DdpkitError as e:
            print(f"ddpkit: error: {e}", file=sys.stderr, flush=True)
            code = getattr(e, "exit_code", 2)
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated) before a launch handles signals
            signum = getattr(e, "signum", signal.SIGINT)
            print(f"ddpkit: stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
            code = 128 + signum
    if argv is None and COMMANDS[ns.command].quick_exit and not os.environ.get(SLOW_EXIT_VAR):
        quick_exit(code)
    return code


@contextlib.contextmanager
def terminated_as_interrupt(install: bool) -> Iterator[None]:
    """SIGTERM raises Terminated (a KeyboardInterrupt) in the command line's own process: it
    unwinds as Ctrl-C does, so that a TERM in the first seconds (while torch loads, before a
    launch handles signals) leaves nothing half made and says so, instead of ending the process
    where it stands. Only for the real command line (`install`), never in a caller's process."""
    if not install or threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum: int, frame: Any) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def quick_exit(code: int) -> None:
    """End the command-line process now: the work is done, the workers are gone and
    everything is written. The interpreter's own teardown of torch takes ~1 s more (measured)
    and does nothing a finished run needs. Only for the real CLI (argv from the command
    line), never when main() is called from Python; DDPKIT_SLOW_EXIT=1 turns it off."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
