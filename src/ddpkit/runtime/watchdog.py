"""When a job hangs, every rank says where it is, without a rerun.

A thread per rank (HangWatchdog) watches for two things:
  * no progress on this rank for --hang-timeout seconds (progress: a forward pass of the
    model, or a collective that completed; for a script `ddpkit launch` runs, what its
    `progress` sampler sees change, launchers/bootstrap.py): a hang anywhere, inside a
    collective or not (a rank stuck in data loading, in a sleep, in a collective the others
    never reach);
  * a request from another rank (a file RUN_DIR/hang/request): some rank hit its
    collective --timeout, or its own watchdog fired.
Either way the rank writes RUN_DIR/hang/rank-R.txt (every thread's Python stack, by
faulthandler, and its last collectives from runtime/record.py) and rank-R.json (the same,
structured), plus torch's flight recorder trace (fr-rank-R.json: the process group's own
collectives with their sequence numbers, gloo and NCCL) and creates the request, so that
every other rank does the same within a second. Rank 0 then waits for the other ranks'
reports (up to REPORT_WAIT_S), writes RUN_DIR/hang/summary.txt (format_summary: which rank
waits in which collective, at which line, and which one never arrived) and prints it when
no ddpkit launcher does (torchrun, srun); ddpkit's launcher prints it once the job has
stopped, also when rank 0 is the one that cannot, and ends the job with one line naming the
rank that hung (hang_summary.hang_line). A rank whose own watchdog fired then ends the job (so
does every rank that answered a request): its reason for the launcher (HANG_FILE), exit code 1.

The thread only reads and writes files; it never runs a collective (the group may be the
thing that is stuck). Ranks on other nodes see the request only when RUN_DIR is one shared
folder; otherwise each node's ranks report for themselves.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ..util.envvars import ERROR_DIR_VAR, error_file, restart_count
from .hang_summary import FR_PATH, format_summary, innermost_user_frame
from .record import CollectiveRecord

if TYPE_CHECKING:
    from ..config import RunConfig
    from .group import Runtime

ATTEMPT_FILE = "attempt"  # beside the request: the restart attempt (torch's count) that hung
REPORT_WAIT_S = 10.0  # rank 0 waits this long for the other ranks' reports
POLL_S = 0.25  # how often the thread looks at the clock and for a request
HANG_FILE = "hang-{rank}.txt"  # in the attempt's error folder: why this rank ended the job


def is_timeout(error: BaseException) -> bool:
    """A collective or store wait that ran past --timeout (gloo, NCCL, the shared-memory barrier)."""
    text = str(error)
    lower = text.lower()
    return "(--timeout)" in text or "timed out" in lower or "timeout" in lower or "Timeout" in type(error).__name__


def fresh_hang_dir(hang_dir: Path) -> None:
    """Rank 0, at the start of a run (or the first rank to report a hang before it): a report left
    by an earlier attempt moves aside (hang-TIME/)."""
    if hang_dir.exists():
        try:
            hang_dir.rename(
                hang_dir.with_name(f"hang-{time.strftime('%Y%m%d-%H%M%S', time.localtime(hang_dir.stat().st_mtime))}")
            )
        except OSError:
            pass


def start_watchdog(cfg: RunConfig, rt: Runtime, hang_dir: Path) -> HangWatchdog | None:
    """A run's watchdog, started: every rank reports where it is when the job hangs; None when
    the run is one process. Under NCCL without --hang-timeout it reports at 0.9 x --timeout,
    before torch aborts a process whose NCCL collective passes --timeout."""
    if not rt.distributed:
        return None
    hang = cfg.hang_seconds
    if rt.backend == "nccl" and cfg.hang_timeout is None:
        hang = 0.9 * cfg.timeout
    error_dir = os.environ.get(ERROR_DIR_VAR)
    watchdog = HangWatchdog(
        hang_dir, rt.env.rank, rt.env.world_size, hang, error_dir, launcher_prints=bool(error_dir), record=rt.record
    )
    return watchdog.start()


@contextlib.contextmanager
def watched(watchdog: HangWatchdog | None) -> Iterator[None]:
    """The training under `watchdog` (None: none): a timeout that ends it is reported first, every
    rank's stacks and collectives, before the job is torn down; the watchdog stops when it ends."""
    try:
        yield
    except Exception as e:
        if watchdog is not None and is_timeout(e):
            watchdog.on_error(e)
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()


class HangWatchdog:
    def __init__(
        self,
        hang_dir: Path | str,
        rank: int,
        world_size: int,
        hang_timeout: float | None,
        error_dir: str | None = None,
        launcher_prints: bool = False,
        *,
        record: CollectiveRecord,
        progress: Callable[[], Any] | None = None,
    ) -> None:
        """`record`: the Runtime's record of this rank's collectives (rt.record), read, never written.
        `progress`: sampled by the thread at every poll; a change in its value counts as progress
        (beat), for code nobody calls beat() in."""
        self.dir = Path(hang_dir)
        self.record = record
        self.progress = progress
        self._seen: Any = None
        self.rank, self.world_size = rank, world_size
        self.hang_timeout = hang_timeout or None  # None/0: report only on request
        self.error_dir = error_dir
        self.launcher_prints = launcher_prints
        self.last_beat = 0.0  # time.time() of the last forward pass; 0 = not armed yet
        self.reported = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._main = threading.main_thread().ident
        self._started = time.time()
        self._thread = threading.Thread(target=self._run, name="ddpkit-hang-watchdog", daemon=True)

    # -- the main thread's side -------------------------------------------------------------
    def start(self) -> HangWatchdog:
        self._thread.start()
        return self

    def beat(self, *_: Any) -> None:
        """Progress (a forward pass); also usable as a forward pre-hook. Arms the watchdog."""
        self.last_beat = time.time()

    def watch_model(self, model: Any) -> Any:
        """Beat at every forward pass of `model` (training and evaluation); returns the hook handle."""
        return model.register_forward_pre_hook(self.beat)

    def stop(self) -> None:
        self._stop.set()

    def on_error(self, error: BaseException) -> None:
        """This rank failed with `error` (a collective timeout, a lost peer): report where
        everyone is, and wait for the report to be complete, before the job is torn down."""
        text = str(error).splitlines()[0] if str(error) else ""
        if text.startswith("[") and "] " in text:  # gloo's "[/path/to/source.cc:78] Timed out ..."
            text = text.split("] ", 1)[1]
        if not self._report(f"rank {self.rank}: {type(error).__name__}: {text[:300]}", error=error):
            self._wait_for_summary()  # the watchdog thread is reporting: the job is torn down only after it

    # -- the watchdog thread ----------------------------------------------------------------
    def _run(self) -> None:
        request = self.dir / "request"
        while not self._stop.wait(POLL_S):
            if self.reported:
                return
            if self.progress is not None:
                seen = self.progress()
                if seen != self._seen:
                    self._seen = seen
                    self.beat()
            if request.exists() and _mtime(request) >= self._started - 1:  # not one of an earlier attempt
                try:
                    reason = request.read_text().strip()
                except OSError:
                    reason = "another rank asked"
                if self._report(reason, responding=True):
                    self._end_job(reason)  # this node's launcher names the hang, not a lost peer
                return  # else the main thread is reporting (a timeout, its own request): it ends the rank
            if self.hang_timeout and self.last_beat:
                idle = time.time() - max(self.last_beat, self.record.last_done)
                if idle > self.hang_timeout:
                    reason = (
                        f"rank {self.rank} made no progress for {idle:.0f} s (--hang-timeout {self.hang_timeout:g})"
                        + self._where_now()
                    )
                    if self._report(reason):
                        self._end_job(reason)
                    return

    def _where_now(self) -> str:
        pending = self.record.pending()
        if pending is not None:
            return f", waiting in {pending.describe()}"
        seen = fr_pending()
        if seen is not None:
            return f", waiting in {seen['op']} #{seen['seq']} (sizes {seen['sizes']}, by torch's flight recorder)"
        frame = sys._current_frames().get(self._main)
        stack = traceback.extract_stack(frame) if frame is not None else []
        return f", outside any collective at {innermost_user_frame(_frames(stack))}" if stack else ""

    def _report(self, reason: str, error: BaseException | None = None, responding: bool = False) -> bool:
        """Write this rank's report (and, on rank 0, the summary once every rank's is in); False
        when another thread of this rank reports already: that one waits for the summary and ends
        the rank, never this caller (ending it now would cut rank 0's wait for this rank short)."""
        with self._lock:
            if self.reported:
                return False
            self.reported = True
        if not responding and 0 < _mtime(self.dir / "request") < self._started - 1:
            # an earlier attempt's report, still there when this one hangs before its start; never a
            # folder without a request: another rank of this attempt, reporting at the same moment,
            # has just made it
            fresh_hang_dir(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        if not responding:
            try:  # the first rank to report names the reason; the others answer it
                fd = os.open(self.dir / "request", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                with os.fdopen(fd, "w") as f:
                    f.write(reason + "\n")
                # which restart attempt hung: the launcher prints this report only if that one failed last
                (self.dir / ATTEMPT_FILE).write_text(f"{restart_count()}\n")
            except FileExistsError:
                pass
        write_report(self.dir, self.rank, reason, self._main, self.record, error)
        if self.rank == 0:
            deadline = time.time() + REPORT_WAIT_S
            while time.time() < deadline and len(list(self.dir.glob("rank-*.json"))) < self.world_size:
                time.sleep(0.1)
            text = format_summary(self.dir, self.world_size)
            tmp = self.dir / "summary.txt.tmp"
            tmp.write_text(text + "\n")
            tmp.replace(self.dir / "summary.txt")
            if not self.launcher_prints:
                print(text, file=sys.stderr, flush=True)
        else:  # stay alive (reachable) until rank 0 has read every report
            self._wait_for_summary()
        return True

    def _wait_for_summary(self) -> None:
        """Until rank 0 has written the summary (every report read), or it cannot have any more."""
        deadline = time.time() + REPORT_WAIT_S + 5
        while time.time() < deadline and not (self.dir / "summary.txt").exists():
            time.sleep(0.1)

    def _end_job(self, reason: str) -> None:
        line = f"{reason}; every rank's stacks and collectives are in {self.dir}"
        if self.error_dir:  # the launcher prints it
            error_file(self.error_dir, HANG_FILE.format(rank=self.rank)).write_text(line)
        else:
            print(f"[rank {self.rank}] ddpkit: error: {line}", file=sys.stderr, flush=True)
        os._exit(1)


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0


def _frames(stack: Any) -> list[dict[str, Any]]:
    return [{"file": fs.filename, "line": fs.lineno, "function": fs.name, "code": fs.line or ""} for fs in stack]


def write_report(
    hang_dir: Path,
    rank: int,
    reason: str,
    main_ident: int | None,
    record: CollectiveRecord,
    error: BaseException | None = None,
) -> None:
    """rank-R.txt (stacks of every thread, the last collectives), rank-R.json, fr-rank-R.json."""
    if error is not None and error.__traceback__ is not None:
        main = _frames(traceback.extract_tb(error.__traceback__))  # where the error was raised: the collective
    else:
        frame = sys._current_frames().get(main_ident or threading.main_thread().ident)
        main = _frames(traceback.extract_stack(frame)) if frame is not None else []
    entries = record.snapshot()
    fr = flight_recorder()
    if error is not None and (not entries or entries[-1]["state"] == "done"):
        failed = _fr_failed(fr, error)  # torch retires a collective that timed out as completed
        if failed is not None:
            entries.append(failed)
    if entries and entries[-1]["state"] != "done" and not entries[-1]["user"]:
        entries[-1]["user"] = innermost_user_frame(main, user_only=True)  # the user's line of the collective it is in
    report = {
        "rank": rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.time(),
        "reason": reason,
        "main_stack": main,
        "collectives": entries,
        "flight_recorder": _fr_status(fr),
    }
    if fr is not None:
        (hang_dir / f"fr-rank-{rank}.json").write_text(json.dumps(fr, indent=1) + "\n")
    with open(hang_dir / f"rank-{rank}.txt", "w") as f:
        f.write(
            f"ddpkit hang report: rank {rank}, host {report['host']}, pid {report['pid']}, "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(report['time']))}\n"
        )
        f.write(f"reason: {reason}\n\nlast collectives issued by this rank (runtime/record.py), oldest first:\n")
        for e in entries[-16:]:
            f.write(
                f"  #{e['seq']:<5} {e['op']:<16} {str(e['shape']):<12} {e['dtype']:<8} {e['path']:<7} "
                f"{e['state'][:60]:<10} {e['what'] or e['caller']}\n"
            )
        if not entries:
            f.write("  none\n")
        if error is not None:
            f.write(
                "\nthe error of this rank:\n"
                + "".join(traceback.format_exception(type(error), error, error.__traceback__))
            )
        f.write("\nPython stacks of every thread (faulthandler, most recent call first):\n")
        f.flush()
        faulthandler.dump_traceback(f, all_threads=True)
    tmp = hang_dir / f".rank-{rank}.json.tmp"
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(hang_dir / f"rank-{rank}.json")  # complete or absent: rank 0 counts these


def flight_recorder() -> dict[str, Any] | None:
    """torch's flight recorder trace of this process (its process groups' collectives), or None
    when it is off (TORCH_FR_BUFFER_SIZE=0) or this torch has none."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        trace = json.loads(_dump_fr_trace_json())
    except Exception:
        return None
    return trace if trace.get("entries") or trace.get("pg_status") else None


def _fr_failed(fr: dict[str, Any] | None, error: BaseException) -> dict[str, Any] | None:
    """The collective `error` ended, as a record entry, from the flight recorder's newest entry
    (the process group's collectives only: ddpkit's own record has none of a script's)."""
    entries = (fr or {}).get("entries") or []
    if not entries:
        return None
    last = entries[-1]
    return {
        "seq": int(last.get("collective_seq_id", -1)),
        "op": last.get("profiling_name", "?"),
        "shape": (last.get("input_sizes") or [[]])[0],
        "dtype": (last.get("input_dtypes") or ["?"])[0],
        "path": FR_PATH,
        "what": "",
        "caller": "",
        "user": "",
        "started": time.time(),
        "state": f"failed: {str(error).splitlines()[0][:200] if str(error) else type(error).__name__}",
        "seconds": None,
    }


def fr_progress() -> tuple[int, int] | None:
    """(collectives completed, collectives enqueued), summed over this process's groups, by
    torch's flight recorder without its entries (~4 us); None when it has nothing yet."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        status = json.loads(_dump_fr_trace_json(includeCollectives=False)).get("pg_status") or {}
    except Exception:
        return None
    if not status:
        return None
    done = sum(int(st.get("last_completed_collective", -1)) for st in status.values())
    return done, sum(int(st.get("last_enqueued_collective", -1)) for st in status.values())


def fr_pending() -> dict[str, Any] | None:
    """The collective torch's flight recorder shows this process inside ({op, sizes, seq}), if any."""
    counts = fr_progress()
    if counts is None or counts[1] <= counts[0]:
        return None  # (the cheap look first: the full trace is ~45 ms at 2,000 entries)
    return next((st["pending"] for st in (_fr_status(flight_recorder()) or {}).values() if st["pending"]), None)


def _fr_status(fr: dict[str, Any] | None) -> dict[str, Any] | None:
    """The flight recorder's last collectives per process group: enqueued vs completed, and the op pending."""
    if not fr:
        return None
    status = {}
    entries = fr.get("entries", [])
    for pg, st in (fr.get("pg_status") or {}).items():
        enq, done = int(st.get("last_enqueued_collective", -1)), int(st.get("last_completed_collective", -1))
        pending = next(
            (
                e
                for e in reversed(entries)
                if str(e.get("pg_id")) == str(pg) and int(e.get("collective_seq_id", -2)) == enq
            ),
            None,
        )
        status[pg] = {
            "last_enqueued": enq,
            "last_completed": done,
            "pending": None
            if enq <= done or pending is None
            else {
                "op": pending.get("profiling_name"),
                "sizes": pending.get("input_sizes"),
                "dtype": (pending.get("input_dtypes") or ["?"])[0],
                "seq": enq,
            },
        }
    return status


def write_dumped_report(hang_dir: Path, rank: int, pid: int, main_ident: int, dump: str, reason: str) -> None:
    """rank-R.txt and rank-R.json of a process that could not write its own (its watchdog thread
    never ran: the GIL held by a call that does not let go of it), from faulthandler's dump of
    its threads (`dump`, written on a signal by a C handler); rank-R.json as write_report's."""
    report = {
        "rank": rank,
        "host": socket.gethostname(),
        "pid": pid,
        "time": time.time(),
        "reason": reason,
        "main_stack": dumped_frames(dump, main_ident),
        "collectives": [],
        "flight_recorder": None,
    }
    hang_dir.mkdir(parents=True, exist_ok=True)
    (hang_dir / f"rank-{rank}.txt").write_text(
        f"ddpkit hang report: rank {rank}, host {report['host']}, pid {pid}, "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(report['time']))}\n"
        f"reason: {reason}\n\nPython stacks of every thread (faulthandler, on a signal from the launcher, "
        f"most recent call first):\n{dump}"
    )
    tmp = hang_dir / f".rank-{rank}.json.tmp"
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(hang_dir / f"rank-{rank}.json")


def dumped_frames(dump: str, thread_ident: int) -> list[dict[str, Any]]:
    """The frames of one thread in a faulthandler dump, outermost first (as traceback lists them)."""
    import linecache
    import re

    frames: list[dict[str, Any]] = []
    inside = False
    for line in dump.splitlines():
        if "(most recent call first)" in line:
            inside = f"0x{thread_ident:016x}" in line
            if inside:
                frames = []  # a later dump of the same thread replaces an earlier one
            continue
        m = re.match(r'\s+File "(.*)", line (\d+) in (.*)', line) if inside else None
        if m:
            file, number = m.group(1), int(m.group(2))
            code = linecache.getline(file, number).strip()
            frames.append({"file": file, "line": number, "function": m.group(3), "code": code})
    return frames[::-1]
