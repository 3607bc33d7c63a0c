"""Several "nodes" on one machine: Linux network namespaces on a private bridge.

Standard library only; needs root, ``ip`` (iproute2) and ``nsenter``/``unshare``
(util-linux).  Typical use::

    from cluster.netns import two_nodes

    with two_nodes("ddpknn") as net:
        n1, n2 = net.nodes
        p = n1.popen(["python3", "-c", "print(1)"], stdout=subprocess.PIPE)
        results = net.run_all([(n1, argv1), (n2, argv2)], timeout=60)

Layout for prefix ``P`` and subnet ``S`` (first three octets of a /24):

* bridge ``P-br`` in the root namespace with address ``S.1`` (the host can reach
  every node; the nodes have no default route, so they reach nothing else);
* node ``i`` (1-based): namespace ``P-n<i>``, host-side veth ``P-v<i>`` on the
  bridge, namespace-side interface ``eth0`` with address ``S.1<i>`` (S.11, S.12, ...),
  ``lo`` up (a node reaches its own address through it).

Everything is removed on exit, also on exceptions: every process left in a
namespace is SIGKILLed (deleting a namespace does not kill its processes), then
veths, namespaces and bridge are deleted.  Leftovers with the same prefix (from a
session that was killed) are removed first.  A lock file per prefix serializes
sessions, so the stale-cleanup can never hit a live session's namespaces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator, Mapping, Sequence

__all__ = [
    "Node",
    "Network",
    "RunResult",
    "network",
    "two_nodes",
    "require_root",
    "ensure_iproute2",
    "kill_netns_processes",
    "run_killable",
]

_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{1,9}$")  # "-" is our separator; IFNAMSIZ is 15
_IP_TIMEOUT = 20.0


# --------------------------------------------------------------------------- helpers
def _ip(*args: str, check: bool = True, timeout: float = _IP_TIMEOUT) -> subprocess.CompletedProcess:
    p = subprocess.run(["ip", *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed (rc={p.returncode}): {p.stderr.strip()}")
    return p


def _apt_install(packages: Sequence[str], timeout: float = 900) -> None:
    """apt-get install (no recommends, non-interactive); `apt-get update` only if that fails.

    A temporary /usr/sbin/policy-rc.d (exit 101) keeps postinst scripts from starting
    system daemons; it is removed again only if we created it.
    """
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    policy = Path("/usr/sbin/policy-rc.d")
    made_policy = False
    if not policy.exists():
        policy.write_text("#!/bin/sh\n# temporary, ddpkit test fixture\nexit 101\n")
        policy.chmod(0o755)
        made_policy = True
    try:
        cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if p.returncode != 0:
            u = subprocess.run(
                ["apt-get", "update", "-q"],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
            if p.returncode != 0:
                raise RuntimeError(
                    f"apt-get install {' '.join(packages)} failed (rc={p.returncode}):\n"
                    f"{p.stdout[-2000:]}\n{p.stderr[-2000:]}\n(apt-get update: rc={u.returncode} "
                    f"{u.stderr[-1000:]})"
                )
    finally:
        if made_policy:
            with contextlib.suppress(FileNotFoundError):
                policy.unlink()


def ensure_iproute2() -> None:
    """Install iproute2 with apt-get if `ip` is missing (root only)."""
    if shutil.which("ip") is None:
        _apt_install(["iproute2"])
    if shutil.which("ip") is None:
        raise RuntimeError("`ip` still not found after installing iproute2")


def require_root() -> None:
    """pytest.skip() unless we are root and have ip (installed if missing), nsenter, unshare."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("cluster fixtures need root (network namespaces, bridges, daemons)")
    if shutil.which("ip") is None and shutil.which("apt-get") is not None:
        ensure_iproute2()
    missing = [b for b in ("ip", "nsenter", "unshare") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"cluster fixtures need {', '.join(missing)} (iproute2 / util-linux)")


def _proc_start_time(pid: int) -> int | None:
    """Start time (clock ticks since boot) of pid, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _netns_pids(ns: str) -> list[int]:
    p = _ip("netns", "pids", ns, check=False)
    if p.returncode != 0:
        return []
    return [int(x) for x in p.stdout.split() if x.isdigit()]


def kill_netns_processes(ns: str, timeout: float = 10.0) -> list[int]:
    """SIGKILL every process in namespace `ns` until none is left; returns the pids killed."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while True:
        pids = [p for p in _netns_pids(ns) if p != os.getpid()]
        if not pids:
            return killed
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes in netns {ns} survive SIGKILL: {pids}")
        time.sleep(0.05)


def _kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal the process group of proc (we start children in their own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)


def run_killable(argv: Sequence[str], *, timeout: float, check: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(capture_output, text) in a new session; on timeout the whole
    process group is SIGKILLed (not only the direct child) and TimeoutExpired is raised."""
    kwargs.setdefault("stdin", subprocess.DEVNULL)
    proc = subprocess.Popen(
        list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate(timeout=10)
        raise subprocess.TimeoutExpired(list(argv), timeout, out, err) from None
    except BaseException:
        _kill_group(proc)
        proc.wait(timeout=10)
        raise
    cp = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
    if check:
        cp.check_returncode()
    return cp


@contextlib.contextmanager
def _prefix_lock(prefix: str, timeout: float) -> Iterator[None]:
    """Exclusive lock per prefix (held by this process only, released if it dies)."""
    lockdir = Path("/run/lock") if Path("/run/lock").is_dir() else Path(tempfile.gettempdir())
    path = lockdir / f"ddpkit-cluster-{prefix}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{path} is locked: another live test session uses prefix {prefix!r}") from None
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)  # releases the lock


# --------------------------------------------------------------------------- model
@dataclasses.dataclass
class RunResult:
    node: Node
    argv: list[str]
    returncode: int | None  # None: killed after the timeout
    timed_out: bool
    seconds: float
    log_path: Path

    @property
    def output(self) -> str:
        """stdout and stderr of the process, interleaved."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def __str__(self) -> str:
        state = "TIMED OUT" if self.timed_out else f"rc={self.returncode}"
        return (
            f"--- {self.node.name} ({self.node.ip}) {state} after {self.seconds:.1f}s: "
            f"{' '.join(self.argv)}\n{self.output[-6000:]}"
        )


@dataclasses.dataclass
class Node:
    name: str  # "node1"
    netns: str  # "<prefix>-n1"; its file is /run/netns/<netns>
    ip: str  # "10.213.50.11"
    ifname: str  # interface inside the namespace ("eth0"): GLOO_SOCKET_IFNAME
    host_veth: str  # host-side veth on the bridge ("<prefix>-v1")
    hosts_file: Path  # /etc/hosts for this node's UTS/mount namespace (uts=True)
    _network: Network = dataclasses.field(repr=False, default=None, compare=False)

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.netns}"

    def env(self) -> dict[str, str]:
        """Extra environment a torch worker in this node needs (gloo/tensorpipe bind to
        whatever the hostname resolves to, which is 127.0.0.1 here)."""
        return {"GLOO_SOCKET_IFNAME": self.ifname, "TP_SOCKET_IFNAME": self.ifname}

    def command(self, argv: Sequence[str], *, uts: bool = False) -> list[str]:
        """argv wrapped to run inside this node's network namespace.

        uts=True additionally gives the command a private UTS + mount namespace with
        hostname = node name and an /etc/hosts mapping every node name to its IP, so the
        hostname resolves to the node's own address (as on a real cluster).
        nsenter (not `ip netns exec`) keeps the host's /sys mounted.
        """
        cmd = ["nsenter", f"--net={self.netns_path}", "--"]
        if uts:
            script = 'mount --bind "$0" /etc/hosts && echo "$1" >/proc/sys/kernel/hostname && shift && exec "$@"'
            cmd += ["unshare", "--mount", "--uts", "--", "sh", "-c", script, str(self.hosts_file), self.name]
        return cmd + [str(a) for a in argv]

    def popen(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        stdout=None,
        stderr=None,
        inherit_env: bool = True,
        worker_env: bool = True,
        uts: bool = False,
        **kwargs,
    ) -> subprocess.Popen:
        """Start argv inside this node. Environment = os.environ (if inherit_env)
        + self.env() (if worker_env) + env. The child gets its own session (so its
        process group can be killed) and stdin=/dev/null unless given."""
        full_env = dict(os.environ) if inherit_env else {}
        if worker_env:
            full_env.update(self.env())
        full_env.update(env or {})
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(
            self.command(argv, uts=uts), env=full_env, cwd=cwd, stdout=stdout, stderr=stderr, **kwargs
        )
        if self._network is not None:
            self._network._procs.append(proc)
        return proc

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float,
        env: Mapping[str, str] | None = None,
        cwd=None,
        check: bool = False,
        uts: bool = False,
    ) -> subprocess.CompletedProcess:
        """Run argv in this node, capture output (text); kill its process group on timeout."""
        full_env = {**os.environ, **self.env(), **(env or {})}
        return run_killable(self.command(argv, uts=uts), timeout=timeout, check=check, env=full_env, cwd=cwd)

    def pids(self) -> list[int]:
        return _netns_pids(self.netns)

    def kill_all(self) -> list[int]:
        """SIGKILL every process in this node's namespace."""
        killed = kill_netns_processes(self.netns)
        if self._network is not None:
            self._network._reap()
        return killed


@dataclasses.dataclass
class Network:
    prefix: str
    subnet: str  # "10.213.50"
    bridge: str  # "<prefix>-br"
    bridge_ip: str  # "<subnet>.1": the host's address on the bridge
    nodes: list[Node]
    tmpdir: Path  # hosts file and default log folder; removed on exit
    _procs: list = dataclasses.field(default_factory=list, repr=False)
    _port: int = dataclasses.field(default=29400, repr=False)

    def node(self, name_or_index) -> Node:
        if isinstance(name_or_index, int):
            return self.nodes[name_or_index]
        return next(n for n in self.nodes if n.name == name_or_index)

    def next_port(self) -> int:
        """A port not handed out before in this session (the namespaces are ours alone,
        so the only possible collisions are our own earlier runs / TIME_WAIT)."""
        self._port += 7
        return self._port

    def kill_all(self) -> None:
        """SIGKILL every process in every node (e.g. after a failed or hung test)."""
        for n in self.nodes:
            kill_netns_processes(n.netns)
        self._reap()

    def _reap(self) -> None:
        alive = []
        for p in self._procs:
            try:
                p.wait(timeout=0.5 if p.poll() is None else 0)
            except subprocess.TimeoutExpired:
                alive.append(p)
        self._procs = alive

    def run_all(
        self,
        commands: Sequence[tuple[Node, Sequence[str]]],
        *,
        timeout: float,
        env: Mapping[str, str] | None = None,
        cwd=None,
        log_dir=None,
        fail_grace: float | None = 15.0,
        uts: bool = False,
        worker_env: bool = True,
    ) -> list[RunResult]:
        """Start every (node, argv) at once, wait for all (stdout+stderr to a log file each).

        On the overall timeout, or `fail_grace` seconds after the first non-zero exit
        (None: no early stop), every process left in the nodes used is SIGKILLed and
        its result has timed_out=True. Never hangs."""
        log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(dir=self.tmpdir, prefix="run-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        started = []
        ends: dict[int, float] = {}
        t0 = time.monotonic()
        try:
            for i, (node, argv) in enumerate(commands):
                log = log_dir / f"{i}-{node.name}.log"
                with open(log, "wb") as f:
                    p = node.popen(
                        argv, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, uts=uts, worker_env=worker_env
                    )
                started.append((node, list(map(str, argv)), p, log))
            deadline = t0 + timeout

            while len(ends) < len(started):
                now = time.monotonic()
                for i, (_, _, p, _) in enumerate(started):
                    if i not in ends and p.poll() is not None:
                        ends[i] = now
                failed = [ends[i] for i, s in enumerate(started) if i in ends and s[2].returncode != 0]
                if now > deadline or (fail_grace is not None and failed and now > min(failed) + fail_grace):
                    break
                time.sleep(0.05)
        finally:
            unfinished = {i for i, s in enumerate(started) if s[2].poll() is None}
            for node in {started[i][0].netns: started[i][0] for i in unfinished}.values():
                kill_netns_processes(node.netns)
            for i in unfinished:
                _kill_group(started[i][2])
                started[i][2].wait(timeout=10)
        now = time.monotonic()
        return [
            RunResult(
                node=node,
                argv=argv,
                returncode=None if i in unfinished else p.returncode,
                timed_out=i in unfinished,
                seconds=ends.get(i, now) - t0,
                log_path=log,
            )
            for i, (node, argv, p, log) in enumerate(started)
        ]


# --------------------------------------------------------------------------- setup / teardown
def _cleanup_prefix(prefix: str) -> None:
    """Remove every namespace / link named `<prefix>-...` (ours, or stale leftovers).
    Best effort: every step is tried; the first error is raised at the end."""
    errors: list[Exception] = []

    def namespaces() -> list[str]:
        out = _ip("netns", "list", check=False).stdout.splitlines()
        return [ln.split()[0] for ln in out if ln.split() and ln.split()[0].startswith(prefix + "-")]

    for ns in namespaces():
        try:
            kill_netns_processes(ns)
        except Exception as e:
            errors.append(e)
    links = []
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        m = re.match(r"^\d+:\s+([^:@\s]+)", line)
        if m and m.group(1).startswith(prefix + "-"):
            links.append(m.group(1))
    # veths first (deleting one end deletes both, synchronously; netns teardown is async)
    for name in sorted(links, key=lambda n: n.endswith("-br")):
        p = _ip("link", "del", name, check=False)
        if p.returncode != 0 and "Cannot find device" not in p.stderr:
            errors.append(RuntimeError(f"ip link del {name}: {p.stderr.strip()}"))
    for ns in namespaces():
        p = _ip("netns", "del", ns, check=False)
        if p.returncode != 0:
            errors.append(RuntimeError(f"ip netns del {ns}: {p.stderr.strip()}"))
    if errors:
        raise errors[0]


def _check_subnet_free(subnet: str, prefix: str) -> None:
    net = ipaddress.ip_network(f"{subnet}.0/24")
    for line in _ip("-o", "-4", "addr", "show", check=False).stdout.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "inet":
            dev = parts[1]
            addr = ipaddress.ip_interface(parts[3])
            if addr.network.overlaps(net) and not dev.startswith(prefix + "-"):
                raise RuntimeError(
                    f"subnet {net} is already used on this machine ({dev}: {addr}); choose another subnet"
                )


@contextlib.contextmanager
def network(
    prefix: str,
    n: int = 2,
    subnet: str = "10.213.50",
    *,
    lock_timeout: float = 120.0,
    extra_hosts: Mapping[str, str] | None = None,
) -> Iterator[Network]:
    """Create n nodes (namespaces <prefix>-n1..n) on bridge <prefix>-br; remove all on exit.

    prefix: 2-10 chars [a-z0-9], starting with a letter (unique per fixture).
    subnet: first three octets of a private /24 not used on this machine.
    extra_hosts: more name -> IP lines for the nodes' /etc/hosts (uts=True);
    the host's own short hostname -> bridge IP is always included.
    """
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"prefix {prefix!r}: use 2-10 chars [a-z0-9] starting with a letter")
    if not 1 <= n <= 9:
        raise ValueError("1 <= n <= 9")
    ipaddress.ip_network(f"{subnet}.0/24")  # validates
    with _prefix_lock(prefix, lock_timeout):
        _cleanup_prefix(prefix)
        for stale in Path(tempfile.gettempdir()).glob(f"ddpkit-{prefix}-*"):
            shutil.rmtree(stale, ignore_errors=True)  # a dead session's (we hold the lock)
        tmpdir = Path(tempfile.mkdtemp(prefix=f"ddpkit-{prefix}-"))
        net: Network | None = None
        try:
            _check_subnet_free(subnet, prefix)
            bridge = f"{prefix}-br"
            net = Network(prefix=prefix, subnet=subnet, bridge=bridge, bridge_ip=f"{subnet}.1", nodes=[], tmpdir=tmpdir)
            hosts = tmpdir / "hosts"
            host_name = socket.gethostname().split(".")[0]
            lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback", f"{net.bridge_ip} {host_name}"]
            lines += [f"{subnet}.1{i} node{i}" for i in range(1, n + 1)]
            lines += [f"{ip} {name}" for name, ip in (extra_hosts or {}).items()]
            hosts.write_text("\n".join(lines) + "\n")
            hosts.chmod(0o644)
            _ip("link", "add", bridge, "type", "bridge")
            # keep host firewalls (e.g. Docker's FORWARD DROP) out of node-to-node traffic
            _ip(
                "link",
                "set",
                bridge,
                "type",
                "bridge",
                "nf_call_iptables",
                "0",
                "nf_call_ip6tables",
                "0",
                "nf_call_arptables",
                "0",
                check=False,
            )
            _ip("addr", "add", f"{net.bridge_ip}/24", "dev", bridge)
            _ip("link", "set", bridge, "up")
            for i in range(1, n + 1):
                node = Node(
                    name=f"node{i}",
                    netns=f"{prefix}-n{i}",
                    ip=f"{subnet}.1{i}",
                    ifname="eth0",
                    host_veth=f"{prefix}-v{i}",
                    hosts_file=hosts,
                    _network=net,
                )
                net.nodes.append(node)
                _ip("netns", "add", node.netns)
                _ip("link", "add", node.host_veth, "type", "veth", "peer", "name", node.ifname, "netns", node.netns)
                _ip("link", "set", node.host_veth, "master", bridge, "up")
                _ip("-n", node.netns, "addr", "add", f"{node.ip}/24", "dev", node.ifname)
                _ip("-n", node.netns, "link", "set", node.ifname, "up")
                _ip("-n", node.netns, "link", "set", "lo", "up")
            yield net
        finally:
            procs = net._procs if net is not None else []
            for p in procs:
                if p.poll() is None:
                    _kill_group(p)
            try:
                _cleanup_prefix(prefix)  # SIGKILLs everything left in the namespaces
            finally:
                for p in procs:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(timeout=5)
                shutil.rmtree(tmpdir, ignore_errors=True)


def two_nodes(prefix: str = "ddpknn", subnet: str = "10.213.50", **kwargs):
    """network(prefix, n=2, subnet): nodes node1 (<subnet>.11) and node2 (<subnet>.12)."""
    return network(prefix, 2, subnet, **kwargs)
