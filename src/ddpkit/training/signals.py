"""Stop requests from signals (SLURM's time-limit warning, preemption, SIGTERM): the handler
only sets a flag; the trainer asks all ranks at the next step boundary, saves, and stops.

Nothing is saved, printed or requeued inside a handler: a signal may arrive anywhere, also
while a checkpoint is being written. A second signal changes nothing: the first one decides
(a warning followed by the scheduler's SIGTERM still asks for the requeue the warning meant),
and the handlers stay in place until the worker has handed over its stop, so a late signal
cannot kill the process between the checkpoint and the requeue request.

A signal often reaches one node only (Kubernetes evicts one pod, a user kills one launcher): the
step's agreement stops every rank at the same step, and `agreed_signal` tells every rank which
signal it was. A node whose own processes received none then hands the stop to its launcher
(`hand_over`): it exits with that signal's code, as the signalled node does, instead of waiting in
torch's exit barrier (300 s) and then reporting success, which a scheduler would take for the end
of the job (Kubernetes would not restart it)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from types import FrameType
from typing import Any, Callable

from ..util.envvars import AGENT_PID_VAR, ERROR_DIR_VAR, STOPPED_FILE, error_file

# What a scheduler or a user sends to END a job (scancel, preemption, a requeue from outside,
# Ctrl-C): save and stop, but never requeue, or a cancelled job would come back.
ENDING_SIGNALS = frozenset({"SIGTERM", "SIGINT"})


class StopRequest:
    """Installs handlers for the named signals (e.g. ["USR1", "TERM"]); the trainer asks at
    each step boundary, through one all-reduce, whether ANY rank received one."""

    def __init__(self, names: list[str]) -> None:
        self.received: str | None = None  # the first signal
        self.repeats = 0  # signals after the first one (ignored)
        self.names = [n.upper().removeprefix("SIG") for n in names if n]
        self._previous: dict[int, object] = {}
        for name in self.names:
            signum = getattr(signal, f"SIG{name}")
            self._previous[signum] = previous = signal.signal(signum, self._handle)
            early = getattr(previous, "__self__", None)
            if isinstance(early, StopRequest) and early.received and self.received is None:
                self.received = early.received  # came while the process started: see install_early

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
        else:
            self.repeats += 1

    @property
    def wants_requeue(self) -> bool:
        """Not stopped by a signal that ends the job (None: another rank received the signal)."""
        return self.received not in ENDING_SIGNALS

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def __enter__(self) -> StopRequest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def install_early(names: list[str]) -> None:
    """For a process that is itself the worker (an srun task): a signal that arrives while it
    starts (torch loading, the process group forming) is kept, and the worker's StopRequest
    takes it over, instead of the signal's default action killing the process."""
    StopRequest(names)


def agreed_signal(received: str | None, all_max: Callable[[int], int]) -> str | None:
    """The signal that stopped the run, the same on every rank: a signal that ends the job wins over
    a warning (one node evicted while another was warned), then the larger number. `received`: this
    rank's first signal (None: another rank's); `all_max`: the maximum of an int over the ranks."""
    number = int(signal.Signals[received]) if received else 0
    agreed = all_max(number + (64 if received in ENDING_SIGNALS else 0)) % 64
    return signal.Signals(agreed).name if agreed else None


def hand_over(stop: StopRequest | None, summary: dict[str, Any], local_rank: int) -> None:
    """After a stop by a signal, in a worker of ddpkit's launcher: this node's first worker leaves the
    launcher what was saved (STOPPED_FILE: the signal, the step), and when the signal ends the job but
    reached no process of this node, sends it to the launcher, which then stops like the node that
    received it (the workers' own handlers are still in place: the launcher's TERM to them is a repeat)."""
    error_dir, agent = os.environ.get(ERROR_DIR_VAR), os.environ.get(AGENT_PID_VAR, "")
    name = summary.get("stop_signal")
    if not (error_dir and stop is not None and summary.get("stopped_early") and name) or local_rank != 0:
        return
    elsewhere = stop.received is None
    note = {"signal": name, "steps_done": summary.get("steps_done"), "elsewhere": elsewhere}
    path = error_file(error_dir, STOPPED_FILE)
    Path(f"{path}.part").write_text(json.dumps(note))
    os.replace(f"{path}.part", path)
    if elsewhere and name in ENDING_SIGNALS and agent.isdigit():
        os.kill(int(agent), signal.Signals[name])


def stopped_note(attempt_folders: list[Path]) -> dict[str, Any] | None:
    """What this node's workers left of their stop by a signal (hand_over), the newest attempt's."""
    for folder in sorted(attempt_folders, key=lambda p: int(p.name.rpartition("-")[2] or 0), reverse=True):
        try:
            return json.loads((folder / STOPPED_FILE).read_text())
        except (OSError, ValueError):
            continue
    return None
