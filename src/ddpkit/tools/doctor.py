"""`ddpkit env`: what a bug report needs and what ddpkit will do here, with known traps.

Reads versions, devices, the launcher's environment variables and the network set-up; it
starts no process group, touches no other machine (name lookups have a 2 s limit) and only
reads. `collect()` returns plain data (for --json and tests); `format_report()` prints it.
"""

from __future__ import annotations

import glob
import os
import platform
import socket
import sys
import threading
from typing import Any, Mapping

from ..environments import DistEnv, Environment, registry
from ..errors import DdpkitError

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


def collect(environ: Mapping[str, str] | None = None, nproc: int | None = None) -> dict[str, Any]:
    """Everything `ddpkit env` reports, as plain data. `nproc`: what --nproc would be."""
    e = dict(os.environ if environ is None else environ)
    report = {"versions": _versions(), "devices": _devices(e), "launcher": _launcher(e)}
    report["network"] = _network(e, report["launcher"])
    report["plan"] = _plan(report, nproc)
    report["warnings"] = _warnings(e, report)
    return report


def _versions() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from .. import __version__

    cuda_built = torch.version.cuda
    nccl = None
    if cuda_built and dist.is_available() and dist.is_nccl_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - a report must not fail on a half-working CUDA install
            nccl = "built in"
    return {
        "ddpkit": __version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": torch.__version__,
        "cuda": cuda_built,  # None: a CPU build of torch
        "cudnn": str(torch.backends.cudnn.version()) if cuda_built and torch.backends.cudnn.is_available() else None,
        "nccl": nccl,
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "mpi": dist.is_available() and dist.is_mpi_available(),
        "platform": platform.platform(),
        "torch_bytecode_cached": _bytecode_cached(torch.__file__),
    }


def _bytecode_cached(source: str) -> bool:
    """Whether Python keeps a compiled copy of this module (its __pycache__ file exists)."""
    import importlib.util

    try:
        return os.path.exists(importlib.util.cache_from_source(source))
    except (NotImplementedError, ValueError):  # no cache tag, or an unusual path: nothing to say
        return True


def _devices(e: Mapping[str, str]) -> dict[str, Any]:
    import torch

    from ..runtime import cuda_device_count, usable_cores

    gpus = []
    for i in range(cuda_device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1)})
    mem = _meminfo()
    return {
        "cpu_cores_usable": usable_cores(),
        "cpu_cores_total": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "memory_total_gib": mem.get("MemTotal"),
        "memory_available_gib": mem.get("MemAvailable"),
        "gpus": gpus,
        "gpu_device_files": len(glob.glob("/dev/nvidia[0-9]*")),  # GPUs on the machine, whatever is hidden
        "CUDA_VISIBLE_DEVICES": e.get("CUDA_VISIBLE_DEVICES"),
        "OMP_NUM_THREADS": e.get("OMP_NUM_THREADS"),
    }


def _launcher(e: Mapping[str, str]) -> dict[str, Any]:
    """The first environment whose variables are here names the launcher (SLURM's batch
    script too, which places nobody); every environment adds what it has to say."""
    found = next(environment for environment in registry.ENVIRONMENTS if environment.present(e))
    out: dict[str, Any] = {"name": _shown_name(found)}
    for environment in registry.ENVIRONMENTS:
        out.update(environment.details(e))
    try:
        feeds_launcher = any(environment.feeds_launcher(e) for environment in registry.ENVIRONMENTS)
        env = DistEnv.detect(e) if feeds_launcher else DistEnv.detect_worker(e)
        out["resolved"] = env.as_dict()
        out["nnodes"] = env.nnodes
    except DdpkitError as err:  # what ddpkit train would refuse with, e.g. no srun on several nodes
        out["error"] = str(err)
    allocated = [n for n in (environment.allocated_nodes(e) for environment in registry.ENVIRONMENTS) if n is not None]
    if allocated:
        out["nnodes"] = max(out.get("nnodes") or 1, *allocated)
    return out


def _shown_name(environment: Environment) -> str:
    return environment.name if environment.outside_launcher else "none"


def _network(e: Mapping[str, str], launcher: Mapping[str, Any]) -> dict[str, Any]:
    from ..environments import network

    hostname = socket.gethostname()
    try:
        interfaces = network.interfaces()
    except OSError:
        interfaces = {}
    known = (environment.master_of(launcher) for environment in registry.ENVIRONMENTS)
    if "MASTER_ADDR" in e:
        master, source = e["MASTER_ADDR"], "MASTER_ADDR"
    else:
        master, source = next((m for m in known if m), ("127.0.0.1", "ddpkit's local launcher, a free port"))
    hostname_ip = _resolve(hostname)
    master_ip = _resolve(master)
    return {
        "hostname": hostname,
        "hostname_resolves_to": hostname_ip,
        "interfaces": interfaces,
        "master_addr": master,
        "master_source": source,
        "master_port": e.get("MASTER_PORT"),
        "master_resolves_to": master_ip,
        "interface_to_master": _interface_towards(master_ip),
        "GLOO_SOCKET_IFNAME": e.get("GLOO_SOCKET_IFNAME"),
        "NCCL_SOCKET_IFNAME": e.get("NCCL_SOCKET_IFNAME"),
    }


def _plan(report: Mapping[str, Any], nproc: int | None) -> dict[str, Any]:
    """What `ddpkit train [--nproc N]` would do with its defaults, in this environment."""
    from ..launchers.plan import resolve_nproc
    from ..runtime import default_threads

    ngpu = len(report["devices"]["gpus"])
    device = "cuda" if ngpu else "cpu"
    launcher = report["launcher"]
    if launcher.get("error"):
        return {"error": launcher["error"]}
    r = launcher.get("resolved")
    if r and DistEnv(**r).outside_launcher:
        procs, world = r["local_world_size"], r["world_size"]
        how = f"this process is rank {r['rank']} of {r['world_size']} in a job started by {r['launcher']}"
    else:
        try:
            procs = resolve_nproc(nproc, device)
        except DdpkitError as err:
            return {"error": str(err)}
        world = procs
        how = f"start {procs} worker process{'es' if procs != 1 else ''} on this machine (torch's elastic agent)"
    backend = "nccl" if device == "cuda" else "gloo"
    return {
        "how": how,
        "processes_per_node": procs,
        "device": device,
        "backend": backend,
        "threads_per_process": default_threads(procs),
        **_grad_sync(world, procs, backend, device),
    }


def _grad_sync(world: int, local: int, backend: str, device: str) -> dict[str, Any]:
    """How --grad-sync auto would all-reduce gradients here, and the room in /dev/shm."""
    import shutil

    from ..runtime.shm import SHM_DIR, why_not_shm

    reason = why_not_shm(world, local, backend, device)
    free = shutil.disk_usage(SHM_DIR).free if os.path.isdir(SHM_DIR) else None
    return {
        "grad_sync": "shm" if reason is None else backend,
        "grad_sync_why": reason,
        "shm_free_mib": None if free is None else round(free / 2**20),
    }


def _warnings(e: Mapping[str, str], r: Mapping[str, Any]) -> list[str]:
    w = []
    dev, launcher, net = r["devices"], r["launcher"], r["network"]
    if launcher.get("error"):  # e.g. several SLURM nodes but no srun: only the first would run
        w.append(launcher["error"])
    visible = e.get("CUDA_VISIBLE_DEVICES")
    physical, seen = dev["gpu_device_files"], len(dev["gpus"])
    if visible is not None and physical and seen < physical:
        w.append(
            f"CUDA_VISIBLE_DEVICES={visible!r} hides {physical - seen} of this machine's {physical} GPUs "
            "(unset it, or check the job's GPU request)"
        )
    elif visible is not None and visible.strip() in ("", "-1", "NoDevFiles"):
        w.append(f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU: training runs on the CPU")
    if physical and not seen and visible is None and not r["versions"]["cuda"]:
        w.append("this machine has GPUs but torch is a CPU build: install a CUDA build of torch")
    procs = r["plan"].get("processes_per_node") or 1
    cores = dev["cpu_cores_usable"]
    omp = _int_or_none(e.get("OMP_NUM_THREADS"))
    if omp and omp * procs > cores:
        w.append(
            f"OMP_NUM_THREADS={omp} x {procs} processes > {cores} usable cores: a script that takes its threads "
            "from it oversubscribes the CPU (DDP gets several times slower); ddpkit train and ddpkit.init() "
            f"use {max(1, cores // procs)} per process instead (--threads)"
        )
    if e.get("PYTHONDONTWRITEBYTECODE") and not r["versions"]["torch_bytecode_cached"]:
        w.append(
            "PYTHONDONTWRITEBYTECODE is set and torch has no compiled copy (installed with pip --no-compile?): every "
            "process compiles torch's modules again when it starts (here 4.1 s of CPU instead of 1.6 s to import "
            "torch); run one process without PYTHONDONTWRITEBYTECODE, or python -m compileall on torch's folder"
        )
    for environment in registry.ENVIRONMENTS:
        w += environment.warnings(launcher, cores)
    plan = r["plan"]
    if plan.get("grad_sync") == "shm" and plan.get("shm_free_mib") is not None and plan["shm_free_mib"] < 256:
        w.append(
            f"/dev/shm has {plan['shm_free_mib']} MiB free: ddpkit's shared-memory gradient sum needs up to 128 MiB "
            "for 2 processes (more for more), else it falls back to gloo (slower); in Docker: --shm-size=1g"
        )
    load = dev["load_average_1min"]
    if load is not None and load > cores:
        w.append(f"load average {load} on {cores} cores: other processes compete for the CPUs; timings will be slow")
    multi_node = (launcher.get("nnodes") or 1) > 1
    if multi_node and net["master_addr"] in LOOPBACK_NAMES:
        w.append(
            f"master address {net['master_addr']} on a multi-node job: the other nodes cannot reach it; "
            "use the first node's hostname or IP"
        )
    if (
        multi_node
        and _is_loopback(net["hostname_resolves_to"])
        and not (e.get("GLOO_SOCKET_IFNAME") or e.get("NCCL_SOCKET_IFNAME"))
    ):
        w.append(
            f"hostname {net['hostname']} resolves to {net['hostname_resolves_to']}: under torchrun or srun gloo would "
            "listen on loopback and the other nodes fail with 'connectFullMesh failed'; set GLOO_SOCKET_IFNAME to "
            "this node's interface (ddpkit train --nnodes sets it itself)"
        )
    return w


def format_report(r: Mapping[str, Any]) -> str:
    """`ddpkit doctor`'s text: one section per part of the report, the warnings last."""
    lines = _version_lines(r["versions"]) + _device_lines(r["devices"]) + _launcher_lines(r["launcher"])
    lines += _network_lines(r["network"]) + _plan_lines(r["plan"], r["warnings"])
    lines.append("warnings" if r["warnings"] else "warnings    none")
    lines += [f"  - {w}" for w in r["warnings"]]
    return "\n".join(lines)


def _version_lines(v: Mapping[str, Any]) -> list[str]:
    lines = ["versions"]
    lines += [f"  {k:<12}{v[k]}" for k in ("ddpkit", "python", "torch")]
    lines.append(
        f"  cuda        {v['cuda']} (the CUDA torch was built for)"
        if v["cuda"]
        else "  cuda        none (a CPU build of torch)"
    )
    lines += [f"  cudnn       {v['cudnn']}"] if v["cudnn"] else []
    return lines + [
        f"  nccl        {v['nccl'] or 'not available'}",
        f"  gloo        {'available' if v['gloo'] else 'not available'}" + ("; mpi available" if v["mpi"] else ""),
        f"  platform    {v['platform']}",
    ]


def _device_lines(d: Mapping[str, Any]) -> list[str]:
    lines = ["devices"]
    mem = (
        f", memory {d['memory_total_gib']} GiB ({d['memory_available_gib']} GiB available)"
        if d["memory_total_gib"]
        else ""
    )
    lines.append(
        f"  cpu         {d['cpu_cores_usable']} usable cores (of {d['cpu_cores_total']}), "
        f"load {d['load_average_1min']}{mem}"
    )
    for g in d["gpus"]:
        lines.append(f"  cuda:{g['index']:<7}{g['name']}, {g['memory_gib']} GiB")
    if not d["gpus"]:
        lines.append(f"  gpu         none visible ({d['gpu_device_files']} GPU device files on this machine)")
    for k in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"):
        if d[k] is not None:
            lines.append(f"  {k}={d[k]}")
    return lines


def _launcher_lines(la: Mapping[str, Any]) -> list[str]:
    lines = ["launcher"]
    found = next(environment for environment in registry.ENVIRONMENTS if _shown_name(environment) == la["name"])
    lines.append(f"  detected    {found.title(la)}")
    for environment in registry.ENVIRONMENTS:
        lines += environment.report_lines(la)
    if "resolved" in la:
        x = la["resolved"]
        lines.append(
            f"  this rank   rank {x.get('rank')}, local rank {x.get('local_rank')}, node rank {x.get('node_rank')}, "
            f"world size {x.get('world_size')}"
        )
    return lines


def _network_lines(net: Mapping[str, Any]) -> list[str]:
    port = f":{net['master_port']}" if net["master_port"] else ""
    lines = [
        "network",
        f"  hostname    {net['hostname']} -> {net['hostname_resolves_to'] or 'does not resolve'}",
        f"  interfaces  {', '.join(f'{k} {ip}' for k, ip in net['interfaces'].items()) or 'unknown'}",
        f"  master      {net['master_addr']}{port} ({net['master_source']}) "
        f"-> {net['master_resolves_to'] or 'does not resolve'}"
        + (f", reached through {net['interface_to_master']}" if net["interface_to_master"] else ""),
    ]
    for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if net[k]:
            lines.append(f"  {k}={net[k]}")
    return lines


def _plan_lines(plan: Mapping[str, Any], warnings: list[str]) -> list[str]:
    lines = ["ddpkit train would"]
    if "error" in plan:
        lines.append(
            "  refuse to start (see the first warning)" if plan["error"] in warnings else f"  refuse: {plan['error']}"
        )
    else:
        lines.append(
            f"  {plan['how']}: device {plan['device']}, backend {plan['backend']}, "
            f"{plan['threads_per_process']} thread(s) per process"
        )
        if plan["grad_sync"] == "shm":
            lines.append(f"  sum gradients in shared memory ({plan['shm_free_mib']} MiB free in /dev/shm)")
        elif plan.get("grad_sync_why") and plan["processes_per_node"] > 1:
            lines.append(f"  all-reduce gradients with {plan['backend']} ({plan['grad_sync_why']})")
    return lines


def _resolve(name: str, timeout: float = 2.0) -> str | None:
    """The first IPv4 (else IPv6) address of a name, or None; never waits more than `timeout`."""
    result: list[str | None] = [None]

    def look_up() -> None:
        try:
            infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
            infos.sort(key=lambda i: i[0] != socket.AF_INET)
            result[0] = str(infos[0][4][0]) if infos else None
        except (OSError, UnicodeError):
            pass

    t = threading.Thread(target=look_up, daemon=True)
    t.start()
    t.join(timeout)
    return result[0]


def _interface_towards(ip: str | None) -> str | None:
    """`NAME (ADDRESS)` of the local interface that traffic to `ip` leaves through."""
    from ..environments import network

    if not ip or ":" in ip:
        return None
    try:
        local = network.source_address_for(ip)  # a UDP connect: no packet is sent
        name = network.interface_of(local)
    except (DdpkitError, OSError):
        return None
    return f"{name} ({local})" if name else local


def _meminfo() -> dict[str, float]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    out[key] = round(int(rest.split()[0]) / 2**20, 1)
    except OSError:
        pass
    return out


def _is_loopback(ip: str | None) -> bool:
    return bool(ip) and (ip.startswith("127.") or ip == "::1")


def _int_or_none(v: Any) -> int | None:
    try:
        return int(str(v).split("(")[0])
    except (TypeError, ValueError):
        return None
