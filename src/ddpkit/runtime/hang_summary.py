"""Reading a hang report (runtime/watchdog.py writes one file per rank): which rank waits in which
collective, which never arrived, where each one's main thread is. Two views of one analysis:
format_summary (a line per rank and a verdict, what rank 0 writes to RUN_DIR/hang/summary.txt)
and hang_line (the one line a launcher ends the job with, naming the rank that hung, not the
ones that waited for it)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .record import is_library, short


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


def load_reports(hang_dir: Path) -> dict[int, dict[str, Any]]:
    """Every rank's rank-R.json that is complete (a rank writes it whole or not at all)."""
    reports = {}
    for p in hang_dir.glob("rank-*.json"):
        try:
            r = json.loads(p.read_text())
            reports[int(r["rank"])] = r
        except (OSError, ValueError, KeyError):
            continue
    return reports


@dataclass
class Analysis:
    """Where each rank was when the reports were written."""

    world: int
    reports: dict[int, dict[str, Any]]
    lines: list[str] = field(default_factory=list)  # one per rank, for the summary
    waiting: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> the collective it waits in
    outside: dict[int, str] = field(default_factory=dict)  # rank -> where its main thread is, in no collective

    @property
    def missing(self) -> list[int]:
        return [r for r in range(self.world) if r not in self.reports]

    @property
    def first_reason(self) -> str:
        first = min(self.reports.values(), key=lambda r: r["time"]) if self.reports else None
        return first["reason"] if first else ""


def analyse(hang_dir: Path | str, world_size: int | None = None) -> Analysis:
    hang_dir = Path(hang_dir)
    reports = load_reports(hang_dir)
    found = Analysis(world_size or (max(reports) + 1 if reports else 0), reports)
    for rank in range(found.world):
        r = reports.get(rank)
        if r is None:
            found.lines.append(
                f"  rank {rank:<3} no report (the process is gone, or RUN_DIR is not this folder on its node)"
            )
            continue
        host = f"[{r['host']}] "
        fr_line = _fr_line(r.get("flight_recorder"))
        last = _pending(r)
        if last is not None:
            found.waiting[rank] = last
            if last["path"] == FR_PATH and last["state"] == "waiting":
                found.lines.append(f"  rank {rank:<3} {host}waiting in {_describe(last)}, at {last['user']}{fr_line}")
                continue
            state = "timed out in" if last["state"].startswith("failed") else "waiting in"
            since = f" for {r['time'] - last['started']:.1f} s" if last["state"] == "waiting" else ""
            at = last["user"] or last["caller"]
            found.lines.append(f"  rank {rank:<3} {host}{state} {_describe(last)}{since}, called at {at}{fr_line}")
        else:
            entries = r.get("collectives") or []
            where = innermost_user_frame(r.get("main_stack") or [])
            found.outside[rank] = where
            done = f" (last: {_describe(entries[-1])}, done)" if entries else ""
            found.lines.append(f"  rank {rank:<3} {host}in no collective{done}; main thread at {where}{fr_line}")
    return found


FR_PATH = "backend, seen by the flight recorder"


def _pending(r: dict[str, Any]) -> dict[str, Any] | None:
    """The collective a rank's report shows it inside, if any: its own record's last entry while
    not done, else one only torch's flight recorder saw (DDP's own), but only while the main
    thread is in library code (a backward, a wait): the recorder can mark a finished gloo op
    completed late, and a rank whose main thread is in the user's code (asleep in a forward)
    is inside no collective."""
    entries = r.get("collectives") or []
    last = entries[-1] if entries else None
    if last is not None and last["state"] != "done":
        return last
    fr_pending = next((st["pending"] for st in (r.get("flight_recorder") or {}).values() if st.get("pending")), None)
    frames = r.get("main_stack") or []
    if fr_pending is None or not frames or not is_library(frames[-1]["file"]):
        return None
    return {
        "seq": fr_pending["seq"],
        "op": fr_pending["op"],
        "shape": (fr_pending["sizes"] or [[]])[0],
        "dtype": fr_pending.get("dtype", "?"),
        "path": FR_PATH,
        "what": "",
        "state": "waiting",
        "started": r["time"],
        "user": innermost_user_frame(frames),
        "caller": "",
    }


def format_summary(hang_dir: Path | str, world_size: int | None = None) -> str:
    """One summary of every rank's report: which ranks wait in which collective (op, shape,
    sequence number) called from which line, which are outside any collective (where), which
    never reported; then a verdict."""
    found = analyse(hang_dir, world_size)
    lines = [f"ddpkit: hang report ({hang_dir}: every rank's Python stacks, collectives, flight recorder)"]
    if found.first_reason:
        lines.append(f"  first reported: {found.first_reason}")
    lines += found.lines
    lines.append("  verdict: " + _verdict(found))
    return "\n".join(lines)


def hang_line(hang_dir: Path | str, world_size: int | None = None) -> str:
    """The one line that ends a hung job: the rank that hung and where (not a rank that waited
    for it), what the others waited in, the first reason given, and where the reports are."""
    found = analyse(hang_dir, world_size)
    where = f"every rank's stacks and collectives are in {hang_dir}"
    reason = f" (first reported: {found.first_reason})" if found.first_reason else ""
    if found.missing:
        what = f"rank(s) {_ranks(found.missing)} did not report: look at their node's log"
    elif found.waiting and found.outside:
        target = ", ".join(sorted({_describe_short(e) for e in found.waiting.values()}))
        waited = f"in which {_rank_words(found.waiting)} waited"
        if len(found.outside) == 1:
            (rank, at), *_ = found.outside.items()
            what = f"rank {rank} hung at {at}: it never reached {target}, {waited}"
        else:
            hung = "; ".join(f"rank {r} at {w}" for r, w in sorted(found.outside.items()))
            what = f"ranks {_ranks(found.outside)} hung ({hung}): they never reached {target}, {waited}"
    elif found.waiting and len({(e["seq"], e["op"]) for e in found.waiting.values()}) > 1:
        what = "the ranks disagree on the collective: " + "; ".join(
            f"rank {r} in {_describe_short(e)} at {e['user'] or e['caller']}" for r, e in sorted(found.waiting.items())
        )
    elif found.waiting:
        what = f"every rank waits in {_describe_short(next(iter(found.waiting.values())))}: the process group is stuck"
    else:
        what = "every rank is stuck outside collectives: " + "; ".join(
            f"rank {r} at {w}" for r, w in sorted(found.outside.items())
        )
    return f"{what}{reason}; {where}"


def _ranks(ranks: Any) -> str:
    return ", ".join(map(str, sorted(ranks)))


def _rank_words(ranks: Any) -> str:
    return f"rank {_ranks(ranks)}" if len(ranks) == 1 else f"ranks {_ranks(ranks)}"


def _describe(e: dict[str, Any]) -> str:
    what = f", {e['what']}" if e.get("what") else ""
    return f"{e['op']} #{e['seq']} (shape {e['shape']}, {e['dtype']}, {e['path']}{what})"


def _describe_short(e: dict[str, Any]) -> str:
    return f"{e['op']} #{e['seq']}"


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


def _verdict(found: Analysis) -> str:
    waiting, outside = found.waiting, found.outside
    if found.missing:
        return (
            f"rank(s) {_ranks(found.missing)} did not report: look at their node's log (a dead process, or a "
            "run directory that is not shared)"
        )
    if waiting and outside:
        keys = {(e["seq"], e["op"]) for e in waiting.values()}
        target = ", ".join(sorted({_describe(e) for e in waiting.values()}))
        never = "; ".join(f"rank {r} at {w}" for r, w in sorted(outside.items()))
        return (
            f"rank(s) {_ranks(outside)} never arrived at {target} that rank(s) {_ranks(waiting)} wait in: {never}"
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
            f"rank(s) {_ranks(ranks)} in {_describe(waiting[ranks[0]])} at "
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
