"""`ddpkit slurm`: write a correct sbatch script, submit it, follow it to its end.

Choice: ONE SRUN TASK PER GPU (per process on CPU nodes). srun starts every worker on every
node; each task is one ddpkit worker that reads its rank from SLURM (SLURM_PROCID,
SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS). So the script holds no per-node variable at all,
nothing can expand on the wrong node, and ddpkit spawns nothing inside a task (which would
multiply processes). Restarts come from SLURM: after the time-limit warning signal the workers
save and stop, the batch script requeues the job (from the batch host: `scontrol` need not exist
where the workers run, e.g. in a container) and the job resumes from its checkpoint (--auto-resume).
SIGTERM (scancel, preemption, a requeue from outside) also saves at the next step, but requeues
nothing: SLURM ends or requeues that job itself.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..config.launch import time_limit_s
from ..config.values import parse_memory
from ..errors import DdpkitError
from ..util.envvars import REQUEUE_FILE_VAR, SLOW_NODES_FILE_VAR
from ..util.jobtoken import TOKEN_FILE_NAME, TOKEN_FILE_VAR

_SIGNAL = re.compile(r"^(B:|R:)?(SIG)?[A-Z0-9]+(@\d+)?$")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
# An array element by its array id and index: one element's JobId is also the ArrayJobId, which
# `scontrol requeue` takes for the WHOLE array (every running element would be requeued)
_THIS_JOB = "${SLURM_ARRAY_TASK_ID:+${SLURM_ARRAY_JOB_ID}_}${SLURM_ARRAY_TASK_ID:-$SLURM_JOB_ID}"
_ARRAY = re.compile(r"^[0-9][0-9,\-:]*(%[0-9]+)?$")
FINAL_OK = {"COMPLETED"}
RUNNING = {
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "REQUEUED",
    "REQUEUE_FED",
    "REQUEUE_HOLD",
    "RESIZING",
    "SUSPENDED",
    "STAGE_OUT",
    "SIGNALING",
}


@dataclass
class SlurmJob:
    """What to ask SLURM for, and the ddpkit train arguments to run in every task."""

    train_args: list[str]
    nodes: int = 1
    gpus_per_node: int = 0
    tasks_per_node: int | None = None  # default: gpus_per_node, or 1 on CPU nodes
    cpus_per_task: int | None = None
    memory: str | None = None  # per node: 64GiB, 500MB, ... (sbatch --mem, in MiB)
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    job_name: str = "ddpkit"
    output: str | None = None  # default: RUN_DIR/slurm-%j.out
    signal: str = "USR2@90"  # time-limit warning: save at the next step, requeue, resume. Not USR1: NCCL and other
    # libraries may install a USR1 handler of their own (submitit moved to USR2 for the same reason)
    python: str = field(default_factory=lambda: sys.executable)
    run_dir: str = ""
    array: str | None = None  # a job array (sbatch --array): each element trains in RUN_DIR/INDEX
    exclude_slow: bool = False  # leave out, at ddpkit's requeue, a node the straggler view named slow (exclude_slow.py)

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise DdpkitError(f"--nodes must be at least 1, got {self.nodes}")
        if self.gpus_per_node < 0:
            raise DdpkitError(f"--gpus-per-node must be 0 or more, got {self.gpus_per_node}")
        if self.tasks_per_node is not None and self.tasks_per_node < 1:
            raise DdpkitError(f"--ntasks-per-node must be at least 1, got {self.tasks_per_node}")
        if self.gpus_per_node and self.tasks_per_node and self.tasks_per_node > self.gpus_per_node:
            raise DdpkitError(
                f"--ntasks-per-node {self.tasks_per_node} is more than --gpus-per-node {self.gpus_per_node}: "
                "ddpkit runs one task per GPU; drop --ntasks-per-node"
            )
        if self.time is not None and _seconds_or_none(self.time) is None:
            raise DdpkitError(f"--time {self.time!r} is not a SLURM time (MM, HH:MM:SS or D-HH:MM:SS)")
        if self.signal and not _SIGNAL.match(self.signal.upper()):
            raise DdpkitError(f"--signal {self.signal!r} is not SIG[@SECONDS], e.g. USR2@90")
        if self.signal and self.signal_name in ("TERM", "INT", "KILL"):
            raise DdpkitError(
                f"--signal {self.signal!r}: SLURM sends {self.signal_name} to end a job (scancel, preemption), so "
                "it cannot ask for a requeue; use USR2@90"
            )
        if self.exclude_slow and not self.signal:
            raise DdpkitError(
                "--exclude-slow leaves slow nodes out when ddpkit requeues the job after the warning signal: "
                "keep --signal (e.g. USR2@90)"
            )
        if self.array is not None and not _ARRAY.match(self.array):
            raise DdpkitError(f"--array {self.array!r} is not a SLURM array, e.g. 0-3, 1,5,9 or 0-15%4")
        for flag, value in (
            ("--job-name", self.job_name),
            ("--partition", self.partition),
            ("--account", self.account),
        ):
            if value is not None and not _SAFE_NAME.match(value):
                raise DdpkitError(f"{flag} {value!r}: use letters, digits, '.', '_' and '-' only")

    @property
    def ntasks_per_node(self) -> int:
        return self.tasks_per_node or self.gpus_per_node or 1

    @property
    def signal_name(self) -> str:
        return self.signal.upper().split(":")[-1].split("@")[0].removeprefix("SIG")


def render_sbatch(job: SlurmJob, command_line: str = "") -> str:
    """The sbatch script. Every value from the user is quoted for the shell (or checked
    to be a plain name), so a hostile value cannot become a command."""
    q = shlex.quote
    output = job.output or str(Path(job.run_dir) / ("slurm-%A_%a.out" if job.array else "slurm-%j.out"))
    lines = [
        "#!/bin/bash",
        f"# written by ddpkit slurm{': ' + command_line if command_line else ''}".replace("\n", " "),
    ]
    for d in _directives(job, output):
        lines.append(f"#SBATCH {d}")
    run_dir = q(job.run_dir or ".") + ('/"$SLURM_ARRAY_TASK_ID"' if job.array else "")
    srun = " ".join(q(a) for a in [*_srun_argv(job)])
    if job.array:
        srun += ' --run-dir "$RUN_DIR"'  # after the user's: the element's own folder wins
    lines += [
        "set -euo pipefail",
        "",
        "# The master is the first node of the allocation; the port is derived from the job id, so",
        "# two jobs sharing a node do not collide. Both are read by ddpkit in every task.",
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        'export MASTER_PORT="$(( 15000 + SLURM_JOB_ID % 20000 ))"',
        f"RUN_DIR={run_dir}" + ("  # each element of the array trains in its own folder" if job.array else ""),
        "# The job token (written by ddpkit slurm, mode 0600, never in this script): the workers' store",
        f"# serves only tasks that hold it (docs/security.md). {TOKEN_FILE_VAR} set at submission wins;",
        "# set empty, the job runs without a token",
        f"token_file={q(str(Path(job.run_dir or '.') / TOKEN_FILE_NAME))}",
        f'export {TOKEN_FILE_VAR}="${{{TOKEN_FILE_VAR}-$token_file}}"',
        "",
        f"# One task per {'GPU' if job.gpus_per_node else 'process'}: {job.nodes} node(s) x {job.ntasks_per_node} = "
        f"world size {job.nodes * job.ntasks_per_node}. Each task is one ddpkit worker and reads its",
        "# own rank from SLURM on its own node; --kill-on-bad-exit stops every task if one fails.",
    ]
    if not job.signal:
        return "\n".join([*lines, srun, ""])
    slow = _exclude_slow_lines(job)
    lines += [
        f"# After the warning signal ({job.signal_name}) every task saves at the next step and stops; rank 0",
        f"# then writes ${REQUEUE_FILE_VAR} and this script, on the batch host (outside any container),",
        "# requeues the job, which continues from that checkpoint (--auto-resume). SIGTERM (scancel,",
        "# preemption) saves too, and SLURM ends or requeues the job itself.",
        f'export {REQUEUE_FILE_VAR}="$RUN_DIR/requeue-request"',
        *slow["setup"],
        f'mkdir -p "$RUN_DIR" && rm -f "${REQUEUE_FILE_VAR}"',
        "status=0",
        srun + " || status=$?",
        f'if [ -e "${REQUEUE_FILE_VAR}" ]; then',
        f'    rm -f "${REQUEUE_FILE_VAR}"',
        *slow["before requeue"],
        '    echo "ddpkit: requeueing SLURM job $SLURM_JOB_ID"',
        f'    scontrol requeue "{_THIS_JOB}"',
        *slow["after requeue"],
        "fi",
        'exit "$status"',
        "",
    ]
    return "\n".join(lines)


def _exclude_slow_lines(job: SlurmJob) -> dict[str, list[str]]:
    """--exclude-slow's lines of the script: rank 0 records the nodes the straggler view names; at a
    requeue, exclude_slow.py decides before it and `scontrol update` sets ExcNodeList after it (SLURM
    changes it only of a job that is not running, and the requeued job starts only once this script
    has ended). The requeue sends SIGTERM to this script: from then on it, and scontrol, ignore it."""
    if not job.exclude_slow:
        return {"setup": [], "before requeue": [], "after requeue": []}
    this = _THIS_JOB
    return {
        "setup": [
            "# --exclude-slow: rank 0 records, check by check, the nodes the straggler view names slow",
            f'export {SLOW_NODES_FILE_VAR}="$RUN_DIR/slow-nodes.json"',
        ],
        "before requeue": [
            "    # the nodes named slow at the last 2 checks in a row that the partition can spare (why: in this log)",
            f'    exclude="$({shlex.quote(job.python)} -m ddpkit.engines.exclude_slow "${SLOW_NODES_FILE_VAR}" '
            f'"{this}" {job.nodes})" || exclude=""',
            "    trap '' TERM  # the requeue signals this script: ExcNodeList must still be set after it",
        ],
        "after requeue": [
            '    if [ -n "$exclude" ]; then',
            f'        scontrol update JobId="{this}" ExcNodeList="$exclude" \\',
            '            || echo "ddpkit: SLURM did not take ExcNodeList=$exclude: the requeued job may run anywhere"',
            "    fi",
        ],
    }


def _directives(job: SlurmJob, output: str) -> list[str]:
    directives = [
        f"--job-name={job.job_name}",
        f"--nodes={job.nodes}",
        f"--ntasks-per-node={job.ntasks_per_node}",
    ]
    if job.gpus_per_node:
        directives.append(f"--gpus-per-node={job.gpus_per_node}")
    if job.cpus_per_task:
        directives.append(f"--cpus-per-task={job.cpus_per_task}")
    if job.memory:
        directives.append(f"--mem={-(-parse_memory(job.memory, '--mem') // 2**20)}M")
    if job.time:
        directives.append(f"--time={job.time}")
    if job.partition:
        directives.append(f"--partition={job.partition}")
    if job.account:
        directives.append(f"--account={job.account}")
    if job.array:
        directives.append(f"--array={job.array}")
    directives += [f"--output={output}", "--open-mode=append", "--requeue"]
    if job.signal:
        directives.append(f"--signal={job.signal.upper()}")
    for d in directives:
        if any(ch.isspace() or ch in "'\"" for ch in d):
            raise DdpkitError(
                f"sbatch directive {d!r} would hold a space or quote, which #SBATCH lines cannot carry "
                "safely: choose a --run-dir / --output path without spaces"
            )
    return directives


def _srun_argv(job: SlurmJob) -> list[str]:
    argv = ["srun", "--kill-on-bad-exit=1", job.python, "-m", "ddpkit", "train", *job.train_args, "--auto-resume"]
    if job.signal:
        argv += ["--save-on-signal", f"{job.signal_name},TERM", "--requeue"]
    return argv


def submit(script: Path, cwd: Path | None = None) -> str:
    proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, cwd=cwd, timeout=60)
    if proc.returncode != 0:
        raise DdpkitError(f"sbatch refused the job: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip().split(";")[0]


def job_state(job_id: str) -> dict[str, str] | None:
    """`scontrol show job -o` as a dict; None once the controller forgot the job."""
    proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    return dict(kv.split("=", 1) for kv in proc.stdout.split() if "=" in kv)


def wait(job_id: str, timeout: float | None = None, poll: float = 1.0, report=print) -> int:
    """Follow the job (through requeues) to its end; its exit status (0 when COMPLETED)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    last = None
    while True:
        info = job_state(job_id)
        if info is None:
            raise DdpkitError(f"job {job_id} is no longer known to SLURM (finished long ago?); see its log")
        state = info.get("JobState", "UNKNOWN")
        shown = (state, info.get("Restarts", "0"))
        if shown != last:
            report(f"ddpkit: job {job_id} {state}" + (f" (requeued {shown[1]}x)" if shown[1] != "0" else ""))
            last = shown
        if state not in RUNNING:
            code, _, sig = info.get("ExitCode", "0:0").partition(":")
            if state in FINAL_OK:
                return 0
            return int(code) if code.isdigit() and int(code) else (128 + int(sig) if sig.isdigit() and int(sig) else 1)
        if deadline is not None and time.monotonic() > deadline:
            raise DdpkitError(
                f"job {job_id} still {state} after {timeout:.0f} s; it keeps running (scancel {job_id} to stop it)"
            )
        time.sleep(poll)


@dataclass(frozen=True)
class Partition:
    """A partition as `sinfo` shows it: its nodes, its time limit (None: infinite) and whether
    it takes jobs (state "up")."""

    name: str
    nodes: int
    time_limit_s: int | None
    up: bool
    default: bool = False


def partitions() -> list[Partition] | None:
    """The cluster's partitions from `sinfo`; None where sinfo is not here or does not answer
    (the job is then checked by sbatch alone)."""
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%P|%D|%l|%a"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_sinfo(proc.stdout) if proc.returncode == 0 else None


def parse_sinfo(text: str) -> list[Partition]:
    """`sinfo -h -o "%P|%D|%l|%a"` read: a partition may fill several lines (one per node
    state): its nodes are summed. The default partition is marked with a '*' after its name."""
    found: dict[str, Partition] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 4 or not parts[1].strip().isdigit():
            continue
        name, nodes, limit, avail = (p.strip() for p in parts)
        default = name.endswith("*")
        name = name.rstrip("*")
        seconds = None if limit in ("infinite", "UNLIMITED", "n/a") else _seconds_or_none(limit)
        before = found.get(name)
        found[name] = Partition(
            name,
            int(nodes) + (before.nodes if before else 0),
            seconds,
            avail == "up",
            default or bool(before and before.default),
        )
    return list(found.values())


def _seconds_or_none(limit: str) -> int | None:
    """The seconds of a time limit as SLURM writes it (config/launch.py reads it); None: not one."""
    try:
        return time_limit_s(limit)
    except DdpkitError:
        return None


def check_against(job: SlurmJob, known: list[Partition] | None) -> str | None:
    """What stops SLURM from ever running `job` on this cluster, in one line (None: nothing
    seen): a partition it lacks or that is down, more nodes than the partition has, a time
    over its limit. sbatch would accept some of these and leave the job pending for ever."""
    if not known:
        return None
    by_name = {p.name: p for p in known}
    chosen = by_name.get(job.partition) if job.partition else next((p for p in known if p.default), None)
    if job.partition and chosen is None:
        return f"--partition {job.partition}: this cluster has no such partition (it has: {', '.join(by_name)})"
    if chosen is None:
        return None
    if not chosen.up:
        return f"partition {chosen.name} is not up (sinfo says so): the job would wait until an admin brings it up"
    if job.nodes > chosen.nodes:
        return (
            f"--nodes {job.nodes}: partition {chosen.name} has {chosen.nodes} node(s); the job could never start "
            "(ask for fewer nodes or another --partition)"
        )
    asked = time_limit_s(job.time) if job.time else None
    if asked is not None and chosen.time_limit_s is not None and asked > chosen.time_limit_s:
        return (
            f"--time {job.time}: partition {chosen.name} allows at most {_clock(chosen.time_limit_s)}; "
            "the job would never start (ask for less, or another --partition)"
        )
    return None


def _clock(seconds: int) -> str:
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{text}" if days else text
