"""A real 2-node SLURM cluster on this one machine, for tests (root, Debian's slurm 22.05).

    from cluster.slurm import slurm_cluster

    with slurm_cluster(tmp_path) as cl:
        job = cl.submit(script, cwd=tmp_path)          # sbatch --parsable
        res = cl.wait(job, timeout=60)                 # JobResult(state, exit_code, ...)
        assert res.ok, cl.diagnostics(job)

What it runs (nothing written to /etc except what apt-get does when the packages
are missing):

* munged as the munge user with a private key and socket (setpriv, foreground);
* slurmctld in the root network namespace, listening on the bridge address
  (<subnet>.1) on a free port;
* slurmd node1 / node2, each in its own network namespace (from cluster.netns, on
  the bridge, <subnet>.11 / .12) plus a private UTS and mount namespace: own
  hostname (node1 / node2) and an /etc/hosts that resolves every node name (bind
  mounted only in that namespace). Jobs and steps run there, so gloo finds the
  right interface from the hostname without GLOO_SOCKET_IFNAME. `ip netns exec`
  can not be used: it remounts /sys and slurmd then misses /sys/fs/cgroup.

Config, logs and job scripts live in `workdir`; sockets, state and spool in a short
private directory under /tmp (unix socket paths are limited to 108 bytes; the
munge user must be able to reach its directory, and pytest's tmp dirs are 0700).

Teardown, always: cancel (SIGKILL) every job, stop exactly the daemons started here
(by PID: SIGTERM, then SIGKILL), SIGKILL whatever is left in the node namespaces,
delete namespaces and bridge. Daemons of a killed earlier session with the same
prefix are found through a registry file and killed at start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pwd
import re
import shutil
import signal as _signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from .netns import Network, Node, _apt_install, _kill_group, _proc_start_time, network, require_root, run_killable

__all__ = [
    "SlurmCluster",
    "JobResult",
    "slurm_cluster",
    "require_slurm",
    "ensure_slurm_packages",
    "SLURM_PACKAGES",
    "TERMINAL_STATES",
]

SLURM_PACKAGES = ["slurmd", "slurmctld", "slurm-client", "munge", "iproute2"]
_NEEDED = [
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "scontrol",
    "squeue",
    "sinfo",
    "scancel",
    "munged",
    "mungekey",
    "munge",
    "unmunge",
    "ip",
]
_SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])

# A job in one of these states has ended (for good, unless something requeues it).
TERMINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"}
)
# Ended, but waiting for someone to release it: wait() returns these too.
HELD_STATES = frozenset({"SPECIAL_EXIT", "REQUEUE_HOLD"})
_HELD_REASONS = ("JobHeldUser", "JobHeldAdmin")


def _which(name: str) -> str | None:
    return shutil.which(name, path=_SBIN_PATH)


def ensure_slurm_packages(timeout: float = 900) -> None:
    """apt-get install slurmd slurmctld slurm-client munge iproute2 if any tool is missing."""
    if all(_which(b) for b in _NEEDED):
        return
    _apt_install(SLURM_PACKAGES, timeout=timeout)
    missing = [b for b in _NEEDED if not _which(b)]
    if missing:
        raise RuntimeError(f"still missing after apt-get install: {missing}")


def require_slurm() -> None:
    """pytest.skip() unless root; installs the packages if needed (fails loudly if that fails)."""
    require_root()
    ensure_slurm_packages()


# --------------------------------------------------------------------------- results
@dataclasses.dataclass
class JobResult:
    job_id: int
    state: str  # final JobState, e.g. COMPLETED, FAILED, CANCELLED, TIMEOUT
    exit_code: int  # ExitCode=<exit_code>:<signal> of the batch script
    signal: int
    restarts: int  # how often it was requeued
    reason: str
    node_list: str
    seconds: float  # how long wait() took
    raw: str = dataclasses.field(repr=False, default="")  # last `scontrol show job -o`

    @property
    def ok(self) -> bool:
        return self.state == "COMPLETED" and self.exit_code == 0 and self.signal == 0


def _field(raw: str, key: str) -> str | None:
    m = re.search(rf"(?:^|\s){key}=(\S*)", raw)
    return m.group(1) if m else None


def _parse_job(job_id: int, raw: str, seconds: float) -> JobResult:
    ec = _field(raw, "ExitCode") or "0:0"
    code, _, sig = ec.partition(":")
    return JobResult(
        job_id=job_id,
        state=(_field(raw, "JobState") or "UNKNOWN"),
        exit_code=int(code or 0),
        signal=int(sig or 0),
        restarts=int(_field(raw, "Restarts") or 0),
        reason=_field(raw, "Reason") or "",
        node_list=_field(raw, "NodeList") or "",
        seconds=seconds,
        raw=raw,
    )


# --------------------------------------------------------------------------- cluster
@dataclasses.dataclass
class _Daemon:
    name: str
    proc: subprocess.Popen
    log: Path


class SlurmCluster:
    """A running cluster. Attributes: env, workdir, conf_path, nodes (netns.Node list:
    name, netns, ip), control_addr, control_port, log_dir, jobs_dir."""

    def __init__(self, workdir: Path, rundir: Path, net: Network, *, cred_expire: int, kill_wait: int, debug: str):
        self.workdir = workdir
        self.rundir = rundir
        self.net = net
        self.nodes: list[Node] = net.nodes
        self.log_dir = workdir / "log"
        self.jobs_dir = workdir / "jobs"
        self.conf_path = workdir / "slurm.conf"
        self.munge_socket = rundir / "munge" / "munge.sock"
        self.control_addr = net.bridge_ip
        self.control_host = socket.gethostname().split(".")[0]
        self.control_port = 0
        self.cred_expire = cred_expire
        self.kill_wait = kill_wait
        self.debug = debug
        self._daemons: list[_Daemon] = []
        self._submitted: list[int] = []
        # Environment for sbatch/srun/scontrol/squeue. Jobs inherit it (sbatch's default
        # --export=ALL), so PATH/PYTHONPATH of this process reach the workers.
        # SLURM_*/SBATCH_*/SRUN_*/SALLOC_* of an outer job would confuse the commands.
        self.env: dict[str, str] = {
            k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))
        }
        self.env["SLURM_CONF"] = str(self.conf_path)
        self.env["PATH"] = _SBIN_PATH

    # ------------------------------------------------------------------ commands
    def cmd(
        self,
        argv: Sequence[str],
        *,
        timeout: float = 30,
        check: bool = True,
        cwd=None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess:
        """Run a slurm client command (sbatch, scontrol, ...) against this cluster."""
        try:
            p = run_killable(list(map(str, argv)), timeout=timeout, cwd=cwd, env={**self.env, **(env or {})})
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"`{' '.join(map(str, argv))}` timed out after {timeout}s\n{self.diagnostics()}") from e
        if check and p.returncode != 0:
            raise RuntimeError(f"`{' '.join(map(str, argv))}` failed (rc={p.returncode}):\n{p.stdout}{p.stderr}")
        return p

    def scontrol(self, *args: str, timeout: float = 30, check: bool = True) -> str:
        return self.cmd(["scontrol", *args], timeout=timeout, check=check).stdout

    def squeue(self, *args: str) -> str:
        return self.cmd(["squeue", *args], check=False).stdout

    def sinfo(self, *args: str) -> str:
        return self.cmd(["sinfo", *args], check=False).stdout

    # ------------------------------------------------------------------ jobs
    def submit(
        self,
        script_path: str | os.PathLike,
        cwd: str | os.PathLike | None = None,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> int:
        """sbatch --parsable [args] script (run from cwd: the job's working directory;
        default: the script's folder). env: extra variables for sbatch (and so the job)."""
        script_path = Path(script_path).resolve()
        cwd = Path(cwd) if cwd is not None else script_path.parent
        p = self.cmd(["sbatch", "--parsable", *args, str(script_path)], cwd=cwd, env=env)
        job_id = int(p.stdout.strip().split(";")[0])
        self._submitted.append(job_id)
        return job_id

    def submit_text(
        self,
        text: str,
        cwd: str | os.PathLike | None = None,
        name: str = "job",
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> int:
        """Write text to <workdir>/jobs/<name>-<n>.sbatch and submit it."""
        self.jobs_dir.mkdir(exist_ok=True)
        path = self.jobs_dir / f"{name}-{len(list(self.jobs_dir.iterdir()))}.sbatch"
        path.write_text(text)
        path.chmod(0o755)
        return self.submit(path, cwd=cwd if cwd is not None else self.workdir, args=args, env=env)

    def job_info(self, job_id: int) -> str | None:
        """`scontrol show job -o ID` (one line), or None if slurmctld no longer knows it."""
        p = self.cmd(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        if p.returncode != 0 or "JobState=" not in p.stdout:
            if "Invalid job id" in p.stderr + p.stdout:
                return None
            raise RuntimeError(f"scontrol show job {job_id} failed: {p.stdout}{p.stderr}")
        return p.stdout.strip()

    def state(self, job_id: int) -> JobResult | None:
        raw = self.job_info(job_id)
        return None if raw is None else _parse_job(job_id, raw, 0.0)

    def wait(
        self,
        job_id: int,
        timeout: float = 60,
        *,
        poll: float = 0.5,
        cancel_on_timeout: bool = True,
        return_on_hold: bool = True,
    ) -> JobResult:
        """Poll `scontrol show job` until the job has really ended and return its final
        state/exit code. A job that is requeued (REQUEUED -> PENDING -> RUNNING again,
        Restarts+1) is followed until its last run ends; a terminal state is only
        believed when a second look shortly after shows the same state and restart count.
        Held jobs (requeuehold / SPECIAL_EXIT / held PENDING) are returned if
        return_on_hold. On timeout the job is cancelled (if cancel_on_timeout) and
        TimeoutError is raised with diagnostics."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        last: JobResult | None = None
        candidate: JobResult | None = None
        while True:
            try:
                raw = self.job_info(job_id)
            except RuntimeError as e:  # e.g. slurmctld busy: retry until the deadline
                if time.monotonic() > deadline:
                    raise TimeoutError(f"job {job_id}: {e}\n{self.diagnostics(job_id)}") from e
                time.sleep(poll)
                continue
            if raw is None:  # purged (MinJobAge): the last look must have been its end
                if last is not None and (last.state in TERMINAL_STATES | HELD_STATES):
                    return last
                raise RuntimeError(f"job {job_id} unknown to slurmctld (last seen: {last})")
            last = _parse_job(job_id, raw, time.monotonic() - t0)
            ended = last.state in TERMINAL_STATES or (
                return_on_hold
                and (last.state in HELD_STATES or (last.state == "PENDING" and last.reason in _HELD_REASONS))
            )
            if ended:
                if candidate is not None and candidate.state == last.state and candidate.restarts == last.restarts:
                    return last
                candidate = last
                time.sleep(min(0.3, poll))
                continue
            candidate = None
            if time.monotonic() > deadline:
                diag = self.diagnostics(job_id)
                if cancel_on_timeout:
                    self.cmd(["scancel", "--signal=KILL", "--full", str(job_id)], check=False)
                    self.cmd(["scancel", str(job_id)], check=False)
                raise TimeoutError(
                    f"job {job_id} still {last.state} (reason {last.reason}, "
                    f"restarts {last.restarts}) after {timeout}s\n{diag}"
                )
            time.sleep(poll)

    def signal(self, job_id: int, sig: int | str, *, scope: str = "full") -> None:
        """scancel --signal=SIG. scope: "full" (batch shell and all steps), "batch" (only
        the batch step: the job script's processes), "steps" (only srun steps, the
        scancel default)."""
        if isinstance(sig, int):
            sig = _signal.Signals(sig).name
        sig = str(sig).upper().removeprefix("SIG")
        flags = {"full": ["--full"], "batch": ["--batch"], "steps": []}[scope]
        self.cmd(["scancel", f"--signal={sig}", *flags, str(job_id)])

    def signal_batch(self, job_id: int, sig: int | str) -> None:
        self.signal(job_id, sig, scope="batch")

    def cancel(self, job_id: int) -> None:
        self.cmd(["scancel", str(job_id)], check=False)

    def cancel_all(self, timeout: float = 15) -> None:
        """SIGKILL and cancel every job, wait (bounded) until squeue is empty."""
        self._cancel_all_jobs(timeout)

    def requeue(self, job_id: int) -> None:
        self.scontrol("requeue", str(job_id))

    # ------------------------------------------------------------------ logs
    def log(self, name: str) -> str:
        """A file of <workdir>/log ("slurmctld.log", "slurmd-node1.log", "munged.log",
        "slurmctld.out", ...) or any path; '' if missing."""
        path = Path(name) if os.path.isabs(name) else self.log_dir / name
        try:
            return path.read_text(errors="replace")
        except OSError:
            return ""

    def diagnostics(self, job_id: int | None = None, tail: int = 25) -> str:
        """squeue/sinfo/job record and the tail of every daemon log, for failure messages."""
        out = []
        ctld_up = any(d.name == "slurmctld" and d.proc.poll() is None for d in self._daemons)
        with contextlib.suppress(Exception):
            if not ctld_up:
                raise RuntimeError("slurmctld not running: no squeue/sinfo")
            out.append("$ squeue\n" + run_killable(["squeue"], timeout=10, env=self.env).stdout)
            out.append("$ sinfo -N\n" + run_killable(["sinfo", "-N"], timeout=10, env=self.env).stdout)
            if job_id is not None:
                out.append(
                    f"$ scontrol show job {job_id}\n"
                    + run_killable(["scontrol", "show", "job", str(job_id)], timeout=10, env=self.env).stdout
                )
        for d in self._daemons:
            state = "running" if d.proc.poll() is None else f"exited {d.proc.returncode}"
            out.append(f"--- {d.name} (pid {d.proc.pid}, {state})")
        for f in sorted([*self.log_dir.glob("*"), *self.rundir.glob("munge/*.log")]):
            n = tail if f.suffix == ".log" else 8  # *.out: stderr, mostly repeats the .log
            lines = self.log(str(f)).splitlines()[-n:]
            out.append(f"--- {f.name} (last {n} lines)\n" + "\n".join(lines))
        return "\n".join(out)

    # ------------------------------------------------------------------ daemons
    def _start(self, name: str, argv: Sequence[str]) -> _Daemon:
        log = self.log_dir / f"{name}.out"
        env = {k: v for k, v in self.env.items() if k != "SLURM_CONF"}
        with open(log, "ab") as f:
            proc = subprocess.Popen(
                list(map(str, argv)),
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        d = _Daemon(name, proc, log)
        self._daemons.append(d)
        _registry_add(self.net.prefix, proc.pid)
        return d

    def _check_alive(self) -> None:
        for d in self._daemons:
            if d.proc.poll() is not None:
                raise RuntimeError(f"{d.name} exited with {d.proc.returncode}\n{self.diagnostics()}")

    def _stop_daemons(self) -> None:
        for d in reversed(self._daemons):  # slurmds, slurmctld, munged
            if d.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    d.proc.send_signal(_signal.SIGTERM)
                try:
                    d.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    _kill_group(d.proc)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        d.proc.wait(timeout=10)

    def _cancel_all_jobs(self, timeout: float = 15) -> None:
        ctld = [d for d in self._daemons if d.name == "slurmctld"]
        if not ctld or ctld[0].proc.poll() is not None:
            return
        ids = self.cmd(["squeue", "-h", "-o", "%A"], check=False, timeout=10).stdout.split()
        if not ids:
            return
        self.cmd(["scancel", "--signal=KILL", "--full", *ids], check=False, timeout=10)
        self.cmd(["scancel", *ids], check=False, timeout=10)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.cmd(["squeue", "-h", "-o", "%A"], check=False, timeout=10).stdout.split():
                return
            time.sleep(0.2)


# --------------------------------------------------------------------------- registry of daemon pids
def _registry_path(prefix: str) -> Path:
    d = Path("/run/lock") if Path("/run/lock").is_dir() else Path(tempfile.gettempdir())
    return d / f"ddpkit-cluster-{prefix}.pids.json"


def _registry_add(prefix: str, pid: int) -> None:
    path = _registry_path(prefix)
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        entries = []
    entries.append({"pid": pid, "start": _proc_start_time(pid)})
    path.write_text(json.dumps(entries))


def _kill_stale_daemons(prefix: str) -> None:
    """SIGKILL daemons a dead earlier session (same prefix) left behind; pid + start time
    must both match, so a recycled pid is never hit. Caller holds the prefix lock."""
    path = _registry_path(prefix)
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        entries = []
    for e in entries:
        if e.get("start") is not None and _proc_start_time(e["pid"]) == e["start"]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(e["pid"], _signal.SIGKILL)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


# --------------------------------------------------------------------------- setup
def _free_port(preferred: int, host: str = "") -> int:
    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port")


def _wait_for(what: str, pred, timeout: float, cluster: SlurmCluster | None = None, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if cluster is not None:
            cluster._check_alive()
        if pred():
            return
        if time.monotonic() > deadline:
            diag = cluster.diagnostics() if cluster is not None else ""
            raise RuntimeError(f"timed out after {timeout}s waiting for {what}\n{diag}")
        time.sleep(interval)


def _write_conf(cl: SlurmCluster, cpus: int) -> None:
    rd = cl.rundir
    lines = [
        "# written by ddpkit tests/cluster/slurm.py",
        "ClusterName=ddpkit",
        f"SlurmctldHost={cl.control_host}({cl.control_addr})",
        f"SlurmctldPort={cl.control_port}",
        "SlurmdPort=6818",  # one per node namespace: no clash
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire also is how long a requeued job waits before it may start again
        f"AuthInfo=socket={cl.munge_socket},cred_expire={cl.cred_expire}",
        "MpiDefault=none",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        # the main loop defaults to 60 s: a requeued job would wait that long to start
        "SchedulerParameters=sched_interval=1,bf_interval=1",
        "ReturnToService=2",
        "JobRequeue=1",
        "MinJobAge=300",  # finished jobs stay queryable for 5 min
        f"KillWait={cl.kill_wait}",  # SIGTERM -> SIGKILL on cancel/timeout/requeue
        "MailProg=/bin/true",
        f"StateSaveLocation={rd / 'state'}",
        f"SlurmdSpoolDir={rd / 'spool'}/%n",
        f"SlurmctldPidFile={rd / 'slurmctld.pid'}",
        f"SlurmdPidFile={rd / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={cl.log_dir / 'slurmctld.log'}",
        f"SlurmdLogFile={cl.log_dir / 'slurmd-%n.log'}",
        f"SlurmctldDebug={cl.debug}",
        f"SlurmdDebug={cl.debug}",
    ]
    for n in cl.nodes:
        lines.append(f"NodeName={n.name} NodeAddr={n.ip} CPUs={cpus} RealMemory=1000 State=UNKNOWN")
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    cl.conf_path.write_text("\n".join(lines) + "\n")


def _start_munge(cl: SlurmCluster, timeout: float) -> None:
    mdir = cl.munge_socket.parent
    pw = pwd.getpwnam("munge")
    mdir.mkdir()
    mdir.chmod(0o755)  # munged insists that everyone may reach its socket
    os.chown(mdir, pw.pw_uid, pw.pw_gid)
    key = mdir / "munge.key"
    run_killable(["mungekey", "-c", "-k", str(key)], timeout=30, check=True, env={"PATH": _SBIN_PATH})
    os.chown(key, pw.pw_uid, pw.pw_gid)
    key.chmod(0o600)
    cl._start(
        "munged",
        [
            "setpriv",
            "--reuid=munge",
            "--regid=munge",
            "--init-groups",
            _which("munged"),
            "--foreground",
            f"--socket={cl.munge_socket}",
            f"--key-file={key}",
            f"--pid-file={mdir / 'munged.pid'}",
            f"--seed-file={mdir / 'munged.seed'}",
            f"--log-file={mdir / 'munged.log'}",
        ],
    )  # the munge user can't write workdir

    def munge_ok() -> bool:
        try:
            cred = run_killable(["munge", "-n", "-S", str(cl.munge_socket)], timeout=5)
            if cred.returncode != 0:
                return False
            p = subprocess.run(
                ["unmunge", "-S", str(cl.munge_socket)], input=cred.stdout, capture_output=True, text=True, timeout=5
            )
            return p.returncode == 0
        except subprocess.TimeoutExpired:
            return False

    _wait_for("munged", munge_ok, timeout, cl)


@contextlib.contextmanager
def slurm_cluster(
    workdir: str | os.PathLike,
    *,
    prefix: str = "ddpksl",
    subnet: str = "10.213.77",
    nodes: int = 2,
    cpus: int | None = None,
    cred_expire: int = 5,
    kill_wait: int = 5,
    start_timeout: float = 60,
    debug: str = "info",
) -> Iterator[SlurmCluster]:
    """Start munged + slurmctld + `nodes` slurmd (node1..nodeN), wait until sinfo shows
    every node idle, yield a SlurmCluster; tear everything down on exit.

    cred_expire: AuthInfo cred_expire (Slurm minimum 5): also the delay before a requeued
    job can start again (default 120 s in Slurm). kill_wait: KillWait, seconds between
    SIGTERM and SIGKILL when a job is cancelled, times out or is requeued.
    cpus: CPUs per node (default: all of this machine's; more than exist is refused).
    """
    ensure_slurm_packages()
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    with network(prefix, nodes, subnet) as net:  # holds the prefix lock
        _kill_stale_daemons(prefix)
        rundir = Path(tempfile.mkdtemp(prefix=f"ddpkit-{prefix}-"))
        rundir.chmod(0o755)  # munged (user munge) must reach rundir/munge
        cl = SlurmCluster(workdir, rundir, net, cred_expire=cred_expire, kill_wait=kill_wait, debug=debug)
        try:
            for d in (cl.log_dir, cl.jobs_dir, rundir / "state", rundir / "spool"):
                d.mkdir(parents=True, exist_ok=True)
            for n in cl.nodes:
                (rundir / "spool" / n.name).mkdir()
            cl.control_port = _free_port(6817)
            _write_conf(cl, cpus or os.cpu_count() or 1)
            _start_munge(cl, timeout=start_timeout)
            cl._start("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", cl.conf_path])
            for n in cl.nodes:
                # slurmd in the node's netns + own UTS/mount ns (hostname, /etc/hosts)
                cl._start(
                    f"slurmd-{n.name}", n.command([_which("slurmd"), "-D", "-N", n.name, "-f", cl.conf_path], uts=True)
                )

            def all_idle() -> bool:
                p = cl.cmd(["sinfo", "-h", "-N", "-o", "%N %T"], check=False, timeout=10)
                states = dict(line.split()[:2] for line in p.stdout.splitlines() if line.strip())
                return p.returncode == 0 and all(states.get(n.name) == "idle" for n in cl.nodes)

            _wait_for("all slurm nodes idle", all_idle, start_timeout, cl, interval=0.2)
            yield cl
        finally:
            try:
                with contextlib.suppress(Exception):
                    cl._cancel_all_jobs()
            finally:
                cl._stop_daemons()
                with contextlib.suppress(OSError):
                    shutil.copy(rundir / "munge" / "munged.log", cl.log_dir / "munged.log")
                with contextlib.suppress(FileNotFoundError):
                    _registry_path(prefix).unlink()
                shutil.rmtree(rundir, ignore_errors=True)
        # leaving `network` SIGKILLs what is left in the node namespaces (slurmstepd, tasks)


if __name__ == "__main__":  # manual use: cd tests && python3 -m cluster.slurm [WORKDIR]
    wd = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="ddpkit-slurm-"))
    with slurm_cluster(wd) as c:
        print(f"export SLURM_CONF={c.conf_path}\n# cluster up; Ctrl-C stops it", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
