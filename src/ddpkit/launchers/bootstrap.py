"""What each worker of `ddpkit launch` runs: the user's script, as python would, inside ddpkit's guard.

torchrun starts `python -u SCRIPT ARGS`; ddpkit launch starts
`python -u -m ddpkit.launchers.bootstrap SCRIPT ARGS` (or `... -m MODULE ARGS`), which runs the
script as `__main__` with what python itself gives it: sys.argv as typed, `__file__` absolute,
sys.path[0] the script's folder (for -m, the working directory), the working directory as it
is, the script's exceptions printed by sys.excepthook (without this file's frames) and its exit
code. Before that it imports nothing of torch: the guard (script_guard.py) patches torch when the
script imports it, so what the script sets before `import torch` still counts.
"""

from __future__ import annotations

import builtins
import io
import os
import runpy
import sys
import types
from importlib.machinery import SourceFileLoader
from typing import Any

from .script_guard import ScriptGuard

USAGE = "python -m ddpkit.launchers.bootstrap (SCRIPT | -m MODULE) [ARGS...]"


def main(argv: list[str]) -> None:
    if not argv or argv[:1] == ["-m"] and len(argv) < 2:
        sys.exit(f"usage: {USAGE}")
    guard = ScriptGuard.from_environ()
    guard.install()
    keep = sys.modules["__main__"]  # noqa: F841  (this module, while the script's takes its place)
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # run_module puts the module's file in argv[0], as python -m does
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            run_file(argv[0])
    except SystemExit as e:
        if e.code in (None, 0):
            guard.returned()
        raise
    except Exception as e:
        guard.failed(e)  # a collective that timed out: every rank's report first
        e = e.with_traceback(_without_own_frames(e.__traceback__))  # (a hook may print e.__traceback__)
        sys.excepthook(type(e), e, e.__traceback__)
        sys.exit(1)
    guard.returned()


def run_file(path: str) -> None:
    """Run the file at `path` as python runs a script: a fresh `__main__` module, sys.path[0] the
    folder of the real file, `__file__` absolute (python >= 3.9: joined to the working directory
    as typed, `..` and all)."""
    full = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    sys.path[0] = os.path.dirname(os.path.realpath(path))
    with io.open_code(full) as f:
        code = compile(f.read(), full, "exec", dont_inherit=True)  # not this file's __future__ imports
    module = types.ModuleType("__main__")
    module.__dict__.update(
        __file__=full,
        __cached__=None,
        __loader__=SourceFileLoader("__main__", full),
        __package__=None,
        __spec__=None,
        __builtins__=builtins,
    )
    sys.modules["__main__"] = module  # pickle finds the script's classes, multiprocessing its file
    exec(code, module.__dict__)


def _without_own_frames(tb: Any) -> Any:
    """The traceback from the script's first frame on, as python would print it."""
    own = (os.path.abspath(__file__), os.path.abspath(runpy.__file__))
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) in own:
        tb = tb.tb_next
    return tb


if __name__ == "__main__":
    main(sys.argv[1:])
