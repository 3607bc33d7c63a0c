"""When a job hangs, every rank says where it is, without a rerun.

A thread per rank (HangWatchdog) watches for two things:
  * no progress on this rank for --hang-timeout seconds (progress: a forward pass of the
    model, or a collective that completed): a hang anywhere, inside a collective or not
    (a rank stuck in data loading, in a sleep, in a collective the others never reach);
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
stopped, also when rank 0 is the one that cannot. A rank whose own watchdog fired then ends
the job (so does every rank that answered a request): one line for the launcher, exit code 2.

The thread only reads and writes files; it never runs a collective (the group may be the
thing that is stuck). Ranks on other nodes see the request only when RUN_DIR is one shared
folder; otherwise each node's ranks report for themselves.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from ..envvars import error_file, restart_count
from .record import CollectiveRecord, is_library, short

ATTEMPT_FILE = "attempt"  # beside the request: the restart attempt (torch's count) that hung
REPORT_WAIT_S = 10.0  # rank 0 waits this long for the other ranks' reports
POLL_S = 0.25  # how often the thread looks at the clock and for a request


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
    ) -> None:
        """`record`: the Runtime's record of this rank's collectives (rt.record), read, never written."""
        self.dir = Path(hang_dir)
        self.record = record
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
        self._report(
            f"rank {self.rank}: {type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}",
            error=error,
        )

    # -- the watchdog thread ----------------------------------------------------------------
    def _run(self) -> None:
        request = self.dir / "request"
        while not self._stop.wait(POLL_S):
            if self.reported:
                return
            if request.exists() and _mtime(request) >= self._started - 1:  # not one of an earlier attempt
                try:
                    reason = request.read_text().strip()
                except OSError:
                    reason = "another rank asked"
                self._report(reason, responding=True)
                self._end_job(reason)  # this node's launcher names the hang, not a lost peer
                return
            if self.hang_timeout and self.last_beat:
                idle = time.time() - max(self.last_beat, self.record.last_done)
                if idle > self.hang_timeout:
                    reason = (
                        f"rank {self.rank} made no progress for {idle:.0f} s (--hang-timeout {self.hang_timeout:g})"
                        + self._where_now()
                    )
                    self._report(reason)
                    self._end_job(reason)
                    return

    def _where_now(self) -> str:
        pending = self.record.pending()
        if pending is not None:
            return f", waiting in {pending.describe()}"
        frame = sys._current_frames().get(self._main)
        stack = traceback.extract_stack(frame) if frame is not None else []
        return f", outside any collective at {innermost_user_frame(_frames(stack))}" if stack else ""

    def _report(self, reason: str, error: BaseException | None = None, responding: bool = False) -> None:
        with self._lock:
            if self.reported:
                return
            self.reported = True
        if not responding and _mtime(self.dir / "request") < self._started - 1:
            fresh_hang_dir(self.dir)  # an earlier attempt's report, still there when this one hangs before its start
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
            deadline = time.time() + REPORT_WAIT_S + 5
            while time.time() < deadline and not (self.dir / "summary.txt").exists():
                time.sleep(0.1)

    def _end_job(self, reason: str) -> None:
        line = f"{reason}; every rank's stacks and collectives are in {self.dir}"
        if self.error_dir:  # the launcher prints it
            error_file(self.error_dir, f"rank-{self.rank}.txt").write_text(line)
        else:
            print(f"[rank {self.rank}] ddpkit: error: {line}", file=sys.stderr, flush=True)
        os._exit(2)


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0


def _frames(stack: Any) -> list[dict[str, Any]]:
    return [{"file": fs.filename, "line": fs.lineno, "function": fs.name, "code": fs.line or ""} for fs in stack]


def innermost_user_frame(frames: list[dict[str, Any]], user_only: bool = False) -> str:
    """FILE:LINE in FUNCTION: CODE of the innermost frame of user code (else the innermost
    frame; with user_only, "")."""
    if not frames:
        return "" if user_only else "?"
    pick = next((f for f in reversed(frames) if not is_library(f["file"])), None)
    if pick is None:
        if user_only:
            return ""
        pick = frames[-1]
    if user_only:
        return f"{short(pick['file'])}:{pick['line']} in {pick['function']}"
    code = f": {pick['code']}" if pick.get("code") else ""
    return f"{short(pick['file'])}:{pick['line']} in {pick['function']}{code}"


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
    if entries and entries[-1]["state"] != "done" and not entries[-1]["user"]:
        entries[-1]["user"] = innermost_user_frame(main, user_only=True)  # the user's line of the collective it is in
    fr = flight_recorder()
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
            else {"op": pending.get("profiling_name"), "sizes": pending.get("input_sizes"), "seq": enq},
        }
    return status


def _load_reports(hang_dir: Path) -> dict[int, dict[str, Any]]:
    reports = {}
    for p in hang_dir.glob("rank-*.json"):
        try:
            r = json.loads(p.read_text())
            reports[int(r["rank"])] = r
        except (OSError, ValueError, KeyError):
            continue
    return reports


def format_summary(hang_dir: Path | str, world_size: int | None = None) -> str:
    """One summary of every rank's report: which ranks wait in which collective (op, shape,
    sequence number) called from which line, which are outside any collective (where), which
    never reported; then a verdict."""
    hang_dir = Path(hang_dir)
    reports = _load_reports(hang_dir)
    world = world_size or (max(reports) + 1 if reports else 0)
    lines = [f"ddpkit: hang report ({hang_dir}: every rank's Python stacks, collectives, flight recorder)"]
    first = min(reports.values(), key=lambda r: r["time"]) if reports else None
    if first:
        lines.append(f"  first reported: {first['reason']}")
    waiting: dict[int, dict[str, Any]] = {}
    outside: dict[int, str] = {}
    for rank in range(world):
        r = reports.get(rank)
        if r is None:
            lines.append(f"  rank {rank:<3} no report (the process is gone, or RUN_DIR is not this folder on its node)")
            continue
        host = f"[{r['host']}] "
        entries = r.get("collectives") or []
        last = entries[-1] if entries else None
        fr_line = _fr_line(r.get("flight_recorder"))
        fr_pending = next(
            (st["pending"] for st in (r.get("flight_recorder") or {}).values() if st.get("pending")), None
        )
        # inside a collective only torch saw (DDP's own): only while the main thread is in library code (a
        # backward); the recorder can mark a finished gloo op completed late, and a rank whose main thread
        # is in the user's code (asleep in a forward) is inside no collective
        frames = r.get("main_stack") or []
        in_library = bool(frames) and is_library(frames[-1]["file"])
        if (last is None or last["state"] == "done") and fr_pending and in_library:
            last = {
                "seq": fr_pending["seq"],
                "op": fr_pending["op"],
                "shape": (fr_pending["sizes"] or [[]])[0],
                "dtype": "?",
                "path": "backend, seen by the flight recorder",
                "what": "",
                "state": "waiting",
                "started": r["time"],
                "user": innermost_user_frame(r.get("main_stack") or []),
                "caller": "",
            }
            waiting[rank] = last
            lines.append(f"  rank {rank:<3} {host}waiting in {_describe(last)}, at {last['user']}{fr_line}")
        elif last is not None and last["state"] != "done":
            waiting[rank] = last
            state = "timed out in" if last["state"].startswith("failed") else "waiting in"
            since = f" for {r['time'] - last['started']:.1f} s" if last["state"] == "waiting" else ""
            at = last["user"] or last["caller"]
            lines.append(f"  rank {rank:<3} {host}{state} {_describe(last)}{since}, called at {at}{fr_line}")
        else:
            where = innermost_user_frame(r.get("main_stack") or [])
            outside[rank] = where
            done = f" (last: {_describe(last)}, done)" if last else ""
            lines.append(f"  rank {rank:<3} {host}in no collective{done}; main thread at {where}{fr_line}")
    lines.append("  verdict: " + _verdict(waiting, outside, world, reports))
    return "\n".join(lines)


def _describe(e: dict[str, Any]) -> str:
    what = f", {e['what']}" if e.get("what") else ""
    return f"{e['op']} #{e['seq']} (shape {e['shape']}, {e['dtype']}, {e['path']}{what})"


def _fr_line(status: dict[str, Any] | None) -> str:
    if not status:
        return ""
    parts = []
    for pg, st in status.items():
        p = st.get("pending")
        if p:
            parts.append(
                f"pg {pg}: {p['op']} #{p['seq']} sizes {p['sizes']} not completed "
                f"(last completed #{st['last_completed']})"
            )
        else:
            parts.append(f"pg {pg}: all {st['last_completed']} completed")
    return "; flight recorder " + ", ".join(parts)


def _verdict(waiting: dict[int, dict[str, Any]], outside: dict[int, str], world: int, reports: dict[int, Any]) -> str:
    missing = [r for r in range(world) if r not in reports]
    if missing:
        return (
            f"rank(s) {', '.join(map(str, missing))} did not report: look at their node's log (a dead process, or a "
            "run directory that is not shared)"
        )
    if waiting and outside:
        keys = {(e["seq"], e["op"]) for e in waiting.values()}
        target = ", ".join(sorted({_describe(e) for e in waiting.values()}))
        never = "; ".join(f"rank {r} at {w}" for r, w in sorted(outside.items()))
        return (
            f"rank(s) {', '.join(map(str, sorted(outside)))} never arrived at {target} that rank(s) "
            f"{', '.join(map(str, sorted(waiting)))} wait in: {never}"
            + (" (ranks also disagree on the collective)" if len(keys) > 1 else "")
        )
    if waiting:
        by_key: dict[tuple[Any, ...], list[int]] = {}
        for rank, e in waiting.items():
            by_key.setdefault((e["seq"], e["op"], tuple(e["shape"]), e["path"]), []).append(rank)
        if len(by_key) == 1:
            return (
                "every rank waits in the same collective: the process group itself is stuck (network, a node "
                "that froze); see the flight recorder files"
            )
        groups = sorted(by_key.items(), key=lambda kv: kv[1])
        desc = "; ".join(
            f"rank(s) {', '.join(map(str, ranks))} in {_describe(waiting[ranks[0]])} at "
            f"{waiting[ranks[0]]['user'] or waiting[ranks[0]]['caller']}"
            for _, ranks in groups
        )
        seqs = sorted({k[0] for k in by_key})
        how = (
            "the same sequence number, different collectives: one rank skipped or added a collective before it"
            if len(seqs) == 1
            else f"different sequence numbers ({', '.join(f'#{s}' for s in seqs)}): a rank "
            "skipped or added a collective"
        )
        return f"ranks are in different collectives: {desc}: {how}"
    return (
        "no rank is in a collective: every rank is stuck outside collectives "
        "(data loading, I/O, a lock): see the stacks"
    )
