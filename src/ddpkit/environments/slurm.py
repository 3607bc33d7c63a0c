"""Where am I inside a SLURM job: ranks from SLURM's variables, master from the nodelist.

One srun task is one ddpkit worker (rank = SLURM_PROCID). This module reads variables (and
may ask `scontrol show hostnames`); it starts nothing. The one exception is the end of a run:
Slurm.requeue, asked by rank 0 after a stop by signal with --requeue, writes the request the
batch script reads or runs `scontrol requeue`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from typing import Any, Mapping

from ..errors import DdpkitError
from ..util.envvars import REQUEUE_FILE_VAR
from ..util.textfile import write_text_atomic
from .base import Environ, Environment, StopRequest

_GROUP = re.compile(r"\[([^\]]*)\]")


class Slurm(Environment):
    """One srun task is one worker. The batch script itself (no srun step) or a one-task
    allocation places nobody: ddpkit starts that node's workers."""

    name = "slurm"
    starter = "srun"
    nproc_fix = "set --ntasks-per-node (one task per GPU) in the job instead"

    def present(self, e: Environ) -> bool:
        return "SLURM_JOB_ID" in e

    def detect(self, e: Environ) -> bool:
        return self.present(e) and in_srun_step(e) and int(e.get("SLURM_NTASKS", "1")) > 1

    def fields(self, e: Environ) -> dict[str, Any]:
        return slurm_fields(e)

    def check_unplaced(self, e: Environ) -> None:
        if self.present(e):
            check_started_by_srun(e)  # a lone task: ddpkit starts this node's workers

    def gpu_index(self, local_rank: int, gpus: int) -> int | None:
        if local_rank >= gpus and gpus == 1:
            return 0  # SLURM bound one GPU to this task (--gpus-per-task / --gpu-bind)
        return super().gpu_index(local_rank, gpus)

    def check_devices(self, local_world_size: int, device_type: str) -> None:
        check_gpus_per_node(local_world_size, device_type)

    def job_id(self, e: Environ) -> str | None:
        return e.get("SLURM_JOB_ID")

    def requeue(self, stop: StopRequest, e: Environ) -> bool:
        """A job that SIGTERM/SIGINT stopped is being ended (scancel) or requeued (preemption) by
        SLURM itself: asking again would bring back a cancelled job.
        The batch script `ddpkit slurm` writes names a file in REQUEUE_FILE_VAR: rank 0 writes it and
        the script requeues the job from the batch host once srun is done, so `scontrol` need not exist
        where the workers run (a container). Without it, rank 0 runs `scontrol requeue` itself.
        Asked whoever placed this process (ddpkit's own workers inside an srun task too)."""
        job = self.job_id(e)
        if not job:
            return False
        if not stop.wants_requeue:
            print(f"ddpkit: checkpoint saved; stopped by {stop.received}: SLURM ends or requeues the job", flush=True)
            return True
        request = e.get(REQUEUE_FILE_VAR)
        if request:
            write_text_atomic(request, f"{job}\n")  # the batch script sees the whole request or none
            print(f"ddpkit: checkpoint saved; the batch script requeues SLURM job {job}", flush=True)
            return True
        requeue_job(job, e)
        return True

    def title(self, report: Mapping[str, Any]) -> str:
        return "SLURM"

    def details(self, e: Environ) -> dict[str, Any]:
        return {"slurm": allocation(e)} if self.present(e) else {}

    def report_lines(self, report: Mapping[str, Any]) -> list[str]:
        s = report.get("slurm")
        if not s:
            return []
        return [
            f"  slurm job   {s['job_id']}: {s['nodes']} node(s) "
            f"{' '.join(s['hosts']) if s['hosts'] else s['nodelist']}, "
            f"{s['ntasks']} task(s) ({s['tasks_per_node']} per node), "
            + ("inside an srun step" if s["in_srun_step"] else "not inside an srun step")
        ]

    def allocated_nodes(self, e: Environ) -> int | None:
        return (_int_or_none(e.get("SLURM_JOB_NUM_NODES", e.get("SLURM_NNODES"))) or 1) if self.present(e) else None

    def master_of(self, report: Mapping[str, Any]) -> tuple[str, str] | None:
        hosts = (report.get("slurm") or {}).get("hosts")
        return (hosts[0], "first node of the SLURM allocation") if hosts else None

    def warnings(self, report: Mapping[str, Any], cores: int) -> list[str]:
        per_task = (report.get("slurm") or {}).get("cpus_per_task")
        if per_task and per_task < cores:
            return [f"SLURM gave {per_task} CPUs per task but {cores} cores are usable here: check --cpus-per-task"]
        return []


def requeue_job(job: str, e: Environ) -> None:
    """SLURM kills this job's processes as soon as the requeue is accepted: say it first. An
    array element is named by array id and index: `scontrol requeue` takes one element's JobId,
    which is also the array's id, for the whole array."""
    print(f"ddpkit: checkpoint saved; requeueing SLURM job {job}", flush=True)
    array, index = e.get("SLURM_ARRAY_JOB_ID"), e.get("SLURM_ARRAY_TASK_ID")
    target = f"{array}_{index}" if array and index else job
    try:
        done = subprocess.run(["scontrol", "requeue", target], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        print(
            f"ddpkit: scontrol is not available here (a container?): SLURM job {job} was not requeued; resubmit it, "
            "or run the script `ddpkit slurm` writes, which requeues from the batch host",
            file=sys.stderr,
            flush=True,
        )
        return
    if done.returncode != 0:
        print(
            f"ddpkit: scontrol requeue {job} failed: {done.stderr.strip()}; resubmit the job to continue",
            file=sys.stderr,
            flush=True,
        )


def allocation(e: Environ) -> dict[str, Any]:
    """The job's allocation as `ddpkit env` shows it (a node list ddpkit cannot read: no hosts)."""
    nodelist = e.get("SLURM_JOB_NODELIST", e.get("SLURM_NODELIST", ""))
    try:
        hosts = hostnames(nodelist) if nodelist else []
    except DdpkitError:
        hosts = []
    return {
        "job_id": e["SLURM_JOB_ID"],
        "nodes": _int_or_none(e.get("SLURM_JOB_NUM_NODES", e.get("SLURM_NNODES"))),
        "nodelist": nodelist,
        "hosts": hosts,
        "ntasks": _int_or_none(e.get("SLURM_NTASKS")),
        "tasks_per_node": e.get("SLURM_NTASKS_PER_NODE", e.get("SLURM_TASKS_PER_NODE")),
        "cpus_per_task": _int_or_none(e.get("SLURM_CPUS_PER_TASK")),
        "in_srun_step": in_srun_step(e),
    }


def _int_or_none(v: Any) -> int | None:
    try:
        return int(str(v).split("(")[0])
    except (TypeError, ValueError):
        return None


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM hostlist ("gpu[01-04,07],cpu-a1", "r[1-2]-n[1-2]") into host names,
    in SLURM's order. Zero padding of a range is kept ("01-10" -> "01".."10")."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        if item:
            hosts.extend(_expand_one(item))
    return hosts


def _split_top_level(s: str) -> list[str]:
    """Split on commas and whitespace that are not inside brackets."""
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise DdpkitError(f"malformed SLURM nodelist {s!r}: unbalanced ']'")
        if (ch == "," or ch.isspace()) and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise DdpkitError(f"malformed SLURM nodelist {s!r}: unbalanced '['")
    parts.append("".join(cur))
    return parts


def _expand_one(item: str) -> list[str]:
    m = _GROUP.search(item)
    if not m:
        return [item]
    prefix, rest = item[: m.start()], item[m.end() :]
    tails = _expand_one(rest)  # later bracket groups vary fastest
    out = []
    for value in _expand_ranges(m.group(1), item):
        out.extend(prefix + value + tail for tail in tails)
    return out


def _expand_ranges(spec: str, item: str) -> list[str]:
    values = []
    for part in spec.split(","):
        part = part.strip()
        if re.fullmatch(r"\d+", part):
            values.append(part)
            continue
        m = re.fullmatch(r"(\d+)-(\d+)", part)
        if not m:
            raise DdpkitError(f"malformed SLURM nodelist entry {item!r}: cannot read range {part!r}")
        lo, hi = m.groups()
        if int(hi) < int(lo):
            raise DdpkitError(f"malformed SLURM nodelist entry {item!r}: range {part!r} runs backwards")
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
        values.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return values


def hostnames(nodelist: str) -> list[str]:
    """`scontrol show hostnames` when it is there (SLURM's own parser), else ours."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10
            )
            if out.returncode == 0 and out.stdout.split():
                return out.stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            pass
    return expand_nodelist(nodelist)


def expand_tasks_per_node(spec: str) -> list[int]:
    """SLURM_TASKS_PER_NODE ("2(x3),1") -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise DdpkitError(f"cannot read SLURM_TASKS_PER_NODE={spec!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def port_for_job(job_id: str | int) -> int:
    """A port derived from the job id: two jobs sharing a node don't collide."""
    return 15000 + int(job_id) % 20000


def slurm_fields(e: Environ) -> dict[str, int | str]:
    """This srun task's place in the job (DistEnv's fields): one task is one worker."""
    nodelist = e.get("SLURM_STEP_NODELIST") or e.get("SLURM_JOB_NODELIST") or e.get("SLURM_NODELIST")
    if not nodelist:
        raise DdpkitError("SLURM_JOB_NODELIST is not set: cannot find the master node")
    hosts = hostnames(nodelist)
    node_rank = int(e.get("SLURM_NODEID", "0"))
    per_node = (
        expand_tasks_per_node(e["SLURM_STEP_TASKS_PER_NODE"])
        if "SLURM_STEP_TASKS_PER_NODE" in e
        else (
            expand_tasks_per_node(e["SLURM_TASKS_PER_NODE"])
            if "SLURM_TASKS_PER_NODE" in e
            else [int(e["SLURM_NTASKS"])]
        )
    )
    local_world = per_node[node_rank] if node_rank < len(per_node) else per_node[0]
    port = int(e["MASTER_PORT"]) if e.get("MASTER_PORT") else port_for_job(e.get("SLURM_JOB_ID", "0"))
    return dict(
        rank=int(e["SLURM_PROCID"]),
        local_rank=int(e.get("SLURM_LOCALID", "0")),
        node_rank=node_rank,
        world_size=int(e["SLURM_NTASKS"]),
        local_world_size=local_world,
        master_addr=e.get("MASTER_ADDR") or hosts[0],
        master_port=port,
    )


def in_srun_step(e: Environ) -> bool:
    """True inside a task started by srun; False in the batch script itself."""
    step = e.get("SLURM_STEP_ID", e.get("SLURM_STEPID"))
    return step is not None and step not in ("4294967294", "batch", "extern")


def check_started_by_srun(e: Environ) -> None:
    """In the batch script itself (no srun), only the first node runs: refuse that."""
    if not in_srun_step(e):
        nodes = int(e.get("SLURM_JOB_NUM_NODES") or e.get("SLURM_NNODES") or "1")
        if nodes > 1:
            raise DdpkitError(
                f"this SLURM job has {nodes} nodes but ddpkit runs in the batch script itself, i.e. on the first "
                "node only: start it with `srun --kill-on-bad-exit=1 ddpkit train ...` "
                "(`ddpkit slurm` writes that script)"
            )


def check_gpus_per_node(local_world_size: int, device_type: str) -> None:
    """One task per GPU: more tasks on a node than it has GPUs cannot work."""
    if device_type != "cuda":
        return
    import torch

    visible = torch.cuda.device_count()
    if visible > 1 and local_world_size > visible:
        raise DdpkitError(
            f"this node runs {local_world_size} SLURM tasks but has {visible} GPUs: ask for "
            f"--ntasks-per-node={visible} (one task per GPU), or more GPUs (--gpus-per-node)"
        )
