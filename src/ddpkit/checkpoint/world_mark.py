"""Which world of a job owns its run directory: the last one that started training there.

Why: an elastic rendezvous can split one job in two. A node whose agent is too busy to send
its keep-alive in time (interval x attempts) is declared dead by a node waiting to join, which
drops it and forms a round without it; the dropped node's agent never re-reads the rendezvous
while its workers are healthy, so both worlds train on and write the same checkpoints,
metrics, model.pt and summary.json. A legitimate restart (a lost node, a crashed worker, a
node admitted) ends the old world before the new one starts, so "the newest world owns the
folder" is always right, and a world that finds the folder owned by another can only be the
one the rendezvous dropped.

Rank 0 of every world writes RUN_DIR/.world atomically when training starts (a fresh token,
its world size, nodes, host, start time). Afterwards rank 0 stats the file once per step (a
few microseconds; the verdict rides the step's agreement, training/step.py) and before every
write that happens after the last step; a file that is no longer the one it wrote, with
another token inside, means another world has taken over.

What this cannot see: a run directory that is not shared between the nodes (each node's own
disk), where the two worlds' rank 0 write different folders; and on NFS a takeover is seen only
once the client's attribute cache expires (seconds).
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from ..errors import RunDirTaken
from ..util.envvars import LAUNCH_ID_VAR
from ..util.textfile import write_text_atomic

MARK_FILE = ".world"


class WorldMark:
    """This world's claim on its run directory. Every rank holds one; only rank 0 touches the
    file, the other ranks learn its verdict from the step's agreement."""

    def __init__(self, run_dir: Path, is_main: bool, world_size: int, nnodes: int) -> None:
        self.path = Path(run_dir) / MARK_FILE
        self.is_main = is_main
        self.mine = {
            "token": uuid.uuid4().hex,
            "world_size": world_size,
            "nnodes": nnodes,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "launch": os.environ.get(LAUNCH_ID_VAR),  # which `ddpkit train` started this world
        }
        self._seen: tuple[int, ...] | None = None  # the file as rank 0 last found it to be ours
        self.owner: dict[str, Any] | None = None  # who took the folder over (rank 0, once lost)

    def claim(self) -> None:
        """Rank 0, before this world writes anything into the folder: the folder is ours now."""
        if not self.is_main:
            return
        write_text_atomic(self.path, json.dumps(self.mine) + "\n")  # another world reads the old mark or ours
        self._seen = _signature(self.path)

    def lost(self) -> bool:
        """Rank 0: has another world claimed the folder since? (one os.stat while it has not).
        Other ranks: False (they hear it from rank 0 through the step's agreement)."""
        if not self.is_main or self._seen is None:
            return False
        if self.owner is not None:
            return True
        try:
            now = _signature(self.path)
        except OSError:
            return False  # removed by hand, or unreadable for now (NFS): no other world is known to own it
        if now == self._seen:
            return False
        found = _read(self.path)
        if found.get("token") == self.mine["token"]:
            self._seen = now  # our own mark, touched: still ours
            return False
        self.owner = found
        return True

    def lost_anywhere(self, collectives: Any, device: torch.device) -> bool:
        """lost(), agreed by every rank (one small all-reduce): for the writes after the last step."""
        flag = torch.tensor([1.0 if self.lost() else 0.0], dtype=torch.float64, device=device)
        if collectives is not None:
            collectives.all_reduce_(flag)
        return flag.item() > 0

    def error(self, where: str, own_loop: bool = False) -> RunDirTaken:
        """What happened, why, and what brings this node back; `where` names the point it stopped at.
        A rank other than 0 reads the new owner's mark itself, where it sees the same folder.
        `own_loop`: the folder an own loop saves into (rt.save), not `ddpkit train`'s run directory."""
        owner = self.owner if self.owner is not None else _read(self.path)
        if owner.get("world_size") is not None:
            other = (
                f"a world of {owner['world_size']} process(es) on {owner.get('nnodes', '?')} node(s), "
                f"started {owner.get('started', '?')} with rank 0 on {owner.get('host', '?')}"
            )
        else:
            other = "another world"
        this = f"{self.mine['world_size']} process(es) on {self.mine['nnodes']} node(s), started {self.mine['started']}"
        if own_loop:
            return RunDirTaken(
                f"{RunDirTaken.OPENING} {self.path.parent} since this world ({this}) first saved there: {other} "
                f"saved there since. This world refused {where} on every rank and wrote nothing (it would replace "
                "the other world's checkpoints): two jobs, or two worlds of one elastic job that the rendezvous "
                "split, save into one folder; give each job its own, and stop this one"
            )
        return RunDirTaken(
            f"{RunDirTaken.OPENING} {self.path.parent} since this world ({this}) started: {other}. This world "
            f"stopped at {where} on every rank and wrote nothing more there (no checkpoint, model.pt or summary.json "
            "that would replace the other world's). In an elastic job (--nnodes MIN:MAX) the rendezvous dropped "
            "this node: its keep-alive expired (an overloaded node) and the other nodes went on without it; with "
            "--max-restarts the launcher restarts these workers and they rejoin the job. Otherwise two runs were "
            "started with one --run-dir: give each its own"
        )


def started_by_this_launch(run_dir: str | os.PathLike) -> bool:
    """Did this launch (LAUNCH_ID_VAR) start training in `run_dir`, i.e. is the folder's mark one
    of its worlds'? A launch refused before its start never marked it. Without the variable
    (a caller outside ddpkit's train), whether any run started there (its config.json)."""
    launch = os.environ.get(LAUNCH_ID_VAR)
    if not launch:
        return (Path(run_dir) / "config.json").exists()
    return _read(Path(run_dir) / MARK_FILE).get("launch") == launch


def rank0_gone(run_dir: str | os.PathLike) -> bool:
    """Is the world that last trained in `run_dir` known to be over: its rank 0 ran on this host and
    no process has its pid now? False whenever that cannot be told (no mark, another host, the pid
    taken by another process since): a live run is never taken for a dead one."""
    mark = _read(Path(run_dir) / MARK_FILE)
    pid = mark.get("pid")
    if mark.get("host") != socket.gethostname() or not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass  # alive, another user's
    return False


def _signature(path: Path) -> tuple[int, ...]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _read(path: Path) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}
