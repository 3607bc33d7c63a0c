"""The stacks of a worker that cannot answer a hang report itself.

Every rank reports where it is when a hang report is asked for (runtime/watchdog.py), from a
thread of its own. A rank whose main thread holds the GIL in a call that never lets go of it (a C
extension stuck in a loop, a deadlock under the GIL) never runs that thread: the report would
say only "no report". The workers of `ddpkit launch` register faulthandler for STACK_SIGNAL
(script_guard.py), whose C handler writes every thread's stack without the GIL. While a launch
runs, StackCollector watches for the report's request; a worker of this node that has not
written its report ANSWER_S later gets the signal, and its dump becomes its report, in time for
rank 0's summary (which waits REPORT_WAIT_S for every rank).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from ..util.envvars import STACKS_FILE, attempt_errors

ANSWER_S = 3.0  # a healthy rank's watchdog thread answers within a poll (0.25 s)
DUMP_WAIT_S = 2.0  # faulthandler's dump is written at once; the file is read until then


class StackCollector:
    def __init__(self, hang_dir: Path, errors: Path, since: float) -> None:
        """`hang_dir`: where the workers write reports; `errors`: the launch's error folder (its
        attempt-N folders hold each worker's STACKS_FILE); `since`: when the launch started."""
        self.hang_dir, self.errors, self.since = hang_dir, errors, since
        self._stop = threading.Event()
        self._done: set[float] = set()  # the requests answered (one per hung attempt)
        self._thread = threading.Thread(target=self._run, name="ddpkit-stack-collector", daemon=True)

    def start(self) -> StackCollector:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        request = self.hang_dir / "request"
        while not self._stop.wait(0.5):
            try:
                asked = request.stat().st_mtime
            except OSError:
                continue
            if asked < self.since - 1 or asked in self._done:
                continue
            self._done.add(asked)
            if not self._stop.wait(max(0.0, asked + ANSWER_S - time.time())):
                self.collect()

    def collect(self) -> list[int]:
        """Signal this node's workers of the hung attempt that have not reported; returns their ranks."""
        from ..runtime.watchdog import ATTEMPT_FILE

        try:
            attempt = int((self.hang_dir / ATTEMPT_FILE).read_text())
        except (OSError, ValueError):
            attempt = 0
        signalled = []
        for stacks in sorted(attempt_errors(self.errors, attempt).glob(STACKS_FILE.split("{")[0] + "*")):
            rank = int(stacks.stem.split("-")[1])
            if (self.hang_dir / f"rank-{rank}.json").exists():
                continue  # it answered
            if self._dump(rank, stacks):
                signalled.append(rank)
        return signalled

    def _dump(self, rank: int, stacks: Path) -> bool:
        from ..runtime.watchdog import write_dumped_report
        from .script_guard import STACK_SIGNAL

        if STACK_SIGNAL is None:
            return False
        try:
            pid, main_ident = (int(x) for x in stacks.read_text().splitlines()[0].split())
            before = stacks.stat().st_size
            os.kill(pid, STACK_SIGNAL)
        except (OSError, ValueError, IndexError):
            return False  # gone already, or not a worker that registered
        deadline = time.time() + DUMP_WAIT_S
        while stacks.stat().st_size == before and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the rest of the dump
        dump = stacks.read_text().split("\n", 1)[1] if stacks.stat().st_size > before else ""
        if not dump or (self.hang_dir / f"rank-{rank}.json").exists():
            return False
        write_dumped_report(
            self.hang_dir,
            rank,
            pid,
            main_ident,
            dump,
            f"rank {rank} did not answer the report's request (its watchdog thread could not run: the GIL "
            "held in a call that keeps it?); its stacks, by a signal from the launcher",
        )
        return True
