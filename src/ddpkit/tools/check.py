"""`ddpkit check`: would a job run here? A pre-flight check on one node or a whole allocation.

It starts the workers a `ddpkit train` with the same flags would start (or runs as one of
them under srun / torchrun), and on every rank:
  * gathers each rank's facts on rank 0 through the job's store (JSON, before any collective, so a
    node with another torch version is still named): host, versions (Python, torch, CUDA,
    NCCL, ddpkit), the backend and network interface it chose, free memory and /dev/shm,
    GPU-node traps (IOMMU, NCCL_P2P_DISABLE, NCCL_SOCKET_IFNAME), `ddpkit env`'s warnings;
  * writes a file into the run directory and reads every other rank's: the run directory
    must be one shared folder (checkpoints, resume, hang reports all need it);
  * compares clocks (after a store barrier), opens a TCP port on every node and connects to
    it from every other node (gloo and NCCL open such ports between nodes);
  * runs real all-reduces through the backend: all ranks, then every pair of nodes (their
    first ranks), with latency (4 bytes) and bus bandwidth (16 MiB, as nccl-tests counts).
Rank 0 prints one table and a verdict line; the exit status is 0 only when a job would run.
Warnings (a clock offset, little /dev/shm) do not fail it; mismatched versions, a run
directory that is not shared, a closed port or a failed all-reduce do.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from ..storage.location import is_url
from .check_report import format_check, judge

PAIR_LIMIT = 16  # nodes: above this, node pairs are not measured one by one (n^2 groups)


# -- what each rank knows about itself -----------------------------------------------------------
def local_facts(rank: int, local_rank: int, node_rank: int, backend: str, master_addr: str) -> dict[str, Any]:
    import torch

    from .. import __version__
    from ..environments import network
    from .doctor import collect

    nccl = None
    if torch.version.cuda and torch.distributed.is_nccl_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - a report must not fail on a half-working CUDA install
            nccl = "built in"
    try:
        iface = os.environ.get(
            "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
        ) or network.interface_of(network.source_address_for(network.resolve(master_addr)))
    except OSError:
        iface = None
    shm = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else None
    report = collect()
    return {
        "rank": rank,
        "local_rank": local_rank,
        "node_rank": node_rank,
        "host": socket.gethostname(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "nccl": nccl,
            "ddpkit": __version__,
        },
        "backend": backend,
        "interface": iface,
        "memory_available_gib": report["devices"]["memory_available_gib"],
        "shm_free_mib": None if shm is None else shm // 2**20,
        "gpus": len(report["devices"]["gpus"]),
        "traps": gpu_traps(backend, len(report["devices"]["gpus"])) + shared_machine_traps(),
        "warnings": report["warnings"],
    }


def gpu_traps(backend: str, gpus: int, environ: dict[str, str] | None = None) -> list[str]:
    """Known NCCL traps of a GPU node, read from the machine (hints: nothing is changed)."""
    e = os.environ if environ is None else environ
    if not gpus:
        return []
    out = []
    if e.get("NCCL_P2P_DISABLE") == "1":
        out.append(
            "NCCL_P2P_DISABLE=1: GPU-to-GPU copies go through host memory (slow); unset it unless P2P hangs here"
        )
    try:
        iommu = bool(os.listdir("/sys/class/iommu"))
    except OSError:
        iommu = False
    cmdline = Path("/proc/cmdline").read_text() if os.path.exists("/proc/cmdline") else ""
    if iommu and "iommu=pt" not in cmdline:
        out.append(
            "the IOMMU is on without iommu=pt: NCCL peer-to-peer traffic can hang or crawl (ACS/IOMMU); "
            "try NCCL_P2P_DISABLE=1 to confirm, then boot with iommu=pt or disable ACS on the PCIe switches"
        )
    if backend == "nccl" and not e.get("NCCL_SOCKET_IFNAME"):
        out.append(
            "NCCL_SOCKET_IFNAME is not set: NCCL picks an interface itself (docker0 or a management network "
            "can make it hang between nodes); set it to the fast network's interface"
        )
    return out


def other_users(proc: Path = Path("/proc")) -> list[int]:
    """The uids of the people (uid 1000 and up, not `nobody`) other than this one that run
    processes on this machine."""
    found = set()
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            uid = next(
                int(line.split()[1]) for line in (entry / "status").read_text().splitlines() if line.startswith("Uid:")
            )
        except (OSError, StopIteration, ValueError, IndexError):
            continue
        if uid >= 1000 and uid != 65534 and uid != os.getuid():
            found.add(uid)
    return sorted(found)


def shared_machine_traps(proc: Path = Path("/proc")) -> list[str]:
    """What another user of this machine could reach of a job (torch has no authentication there)."""
    uids = other_users(proc)
    if not uids:
        return []
    shown = ", ".join(map(str, uids[:5])) + (f" and {len(uids) - 5} more" if len(uids) > 5 else "")
    return [
        f"other users run processes on this machine (uid {shown}): a one-node job's rendezvous and store are "
        "private files, but the connections between its workers (gloo, NCCL), and across nodes the c10d store, "
        "have no authentication in torch: anyone who reaches them can disturb the job; run jobs where the "
        "machine's users and the network are trusted, and across nodes give every node a job token "
        "(DDPKIT_JOB_TOKEN_FILE: it seals the stores, not gloo's or NCCL's connections; docs/security.md)"
    ]


# -- the collective part, in every worker ------------------------------------------------------------
def check_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """In every worker: gather facts, test the run directory, clocks, ports and all-reduces.
    Returns rank 0's full report on rank 0, the verdict elsewhere.

    The facts go through the workers' store as JSON before any process group exists: a node
    with another torch (whose gloo may not speak to this one) is still named; the
    all-reduces run only when every rank has the same versions."""
    import torch

    from ..environments import DistEnv
    from ..runtime.devices import resolve_backend, resolve_device_type
    from ..runtime.store import make_store

    env = DistEnv.detect()
    world, rank = env.world_size, env.rank
    store = make_store(env, spec["timeout"]) if env.distributed else None
    key = spec["key"]
    backend = resolve_backend(spec["backend"], resolve_device_type(spec["device"])) if env.distributed else "none"
    facts = local_facts(rank, env.local_rank, env.node_rank, backend, env.master_addr)
    everyone = gather(store, f"{key}/facts", rank, world, facts)  # rank 0's alone: the others get its digest
    digest = None
    if rank == 0:
        digest = {
            "nodes": node_leaders(everyone),
            "same": len({json.dumps(f["versions"], sort_keys=True) for f in everyone}) == 1,
        }
    digest = share(store, f"{key}/digest", rank, digest)
    nodes, same = digest["nodes"], digest["same"]
    url = spec["run_dir"] if is_url(spec["run_dir"]) else None  # a bucket: each rank checks it answers
    run_dir = Path(spec["run_dir"])
    probe = bucket_probe(url, key, rank, world, store) if url else run_dir_probe(run_dir, key, rank, world, store)
    dirs = gather(store, f"{key}/dir", rank, world, probe)
    barrier(store, f"{key}/clock", rank, world)
    clocks = gather(store, f"{key}/clocks", rank, world, {"time": time.time()})
    ports = port_probe(store, key, rank, world, nodes, env.master_addr)
    allreduce = _allreduce_part(env, spec, store, nodes, same)
    barrier(store, f"{key}/done", rank, world)
    report: dict[str, Any] = {}
    if rank == 0:
        report = {
            "facts": everyone,
            "run_dir": dirs,
            "clocks": clocks,
            "ports": ports,
            "allreduce": allreduce,
            "run_dir_path": url or str(run_dir.resolve()),
        }
        rows, ok = judge(report)
        report.update(rows=rows, ok=ok)
    ok = share(store, f"{key}/verdict", rank, report.get("ok"))  # rank 0's verdict is every rank's
    leave(store, f"{key}/left", rank, world)
    if url is None:
        shutil.rmtree(run_dir / f".ddpkit-check-{key}", ignore_errors=True)  # every rank: its node may see another
    del torch
    return report if rank == 0 else {"ok": ok, "rank": rank}


def _allreduce_part(env: Any, spec: dict[str, Any], store: Any, nodes: Any, same: bool) -> dict[str, Any]:
    """The all-reduces, measured in a process group over the workers' store: {} for one process,
    skipped when the ranks run different versions, the error when the group or a collective fails."""
    from ..runtime import Runtime

    if not env.distributed:
        return {}
    if not same:
        return {"skipped": "the ranks run different versions"}
    try:
        with Runtime(env, spec["device"], spec["backend"], spec["timeout"], spec.get("threads"), store=store) as rt:
            return measure_allreduce(rt, nodes, spec.get("iters", 10))
    except Exception as e:  # noqa: BLE001 - the check reports what fails
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}


def gather(store: Any, key: str, rank: int, world: int, value: Any) -> list[Any] | None:
    """Every rank's `value` (JSON) on rank 0, in rank order (None elsewhere); no collective.
    Only rank 0 reads them all: every rank reading every key was world^2 requests to the store."""
    if store is None:
        return [value]
    store.set(f"{key}/{rank}", json.dumps(value))
    return [json.loads(store.get(f"{key}/{r}")) for r in range(world)] if rank == 0 else None


def share(store: Any, key: str, rank: int, value: Any) -> Any:
    """Rank 0's `value` (JSON) on every rank: one write, one read per rank."""
    if store is None:
        return value
    if rank == 0:
        store.set(key, json.dumps(value))
        return value
    return json.loads(store.get(key))


def barrier(store: Any, key: str, rank: int, world: int) -> None:
    """Every rank waits (at most 60 s) for all to arrive: the last one to arrive opens it, the
    others wait on that key in the store instead of asking for the count every millisecond."""
    if store is not None:
        if int(store.add(key, 1)) >= world:
            store.set(f"{key}/open", "1")
        try:
            store.wait([f"{key}/open"], timedelta(seconds=60))
        except Exception:  # noqa: BLE001 - as before: a late rank is named by what follows, not here
            pass


def leave(store: Any, key: str, rank: int, world: int) -> None:
    """The last store operation: rank 0 (which serves the store) waits until every rank has
    done its last one, so that none finds the server gone."""
    if store is None:
        return
    store.add(key, 1)
    if rank == 0:
        deadline = time.time() + 60
        while int(store.add(key, 0)) < world and time.time() < deadline:
            time.sleep(0.005)


def node_leaders(facts: list[dict[str, Any]]) -> list[int]:
    """The first rank of every node (by host and node rank), in node order."""
    seen: dict[tuple[Any, Any], int] = {}
    for f in facts:
        seen.setdefault((f["node_rank"], f["host"]), f["rank"])
    return sorted(seen.values())


def run_dir_probe(run_dir: Path, key: str, rank: int, world: int, store: Any) -> dict[str, Any]:
    """Write a file into the run directory, then read every rank's: which ranks share this folder?"""
    folder = run_dir / f".ddpkit-check-{key}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank-{rank}").write_text(socket.gethostname())
        error = None
    except OSError as e:
        error = f"cannot write {folder}: {e.strerror}"
    barrier(store, f"{key}/dir-written", rank, world)
    seen = sorted(int(p.name.split("-")[1]) for p in folder.glob("rank-*")) if folder.is_dir() else []
    return {"error": error, "sees": seen}


def bucket_probe(url: str, key: str, rank: int, world: int, store: Any) -> dict[str, Any]:
    """A run folder in a bucket: this rank reaches the store, finds the bucket and writes (and
    deletes) a test object, as `ddpkit train` checks before its workers start. A bucket is one
    place for every rank that reaches it."""
    from ..errors import DdpkitError
    from ..storage.location import Remote, parse
    from ..storage.remote import RemoteRun

    try:
        where = parse(url)
        assert isinstance(where, Remote)
        RemoteRun(where).preflight()
        error = None
    except DdpkitError as e:
        error = str(e)
    barrier(store, f"{key}/dir-written", rank, world)
    return {"error": error, "sees": list(range(world)) if error is None else []}


def port_probe(store: Any, key: str, rank: int, world: int, nodes: list[int], master_addr: str) -> list[dict[str, Any]]:
    """Each node's first rank listens on a free port; every other node's first rank connects.
    Only those first ranks take part in the barrier before the ports close (the others only hand
    rank 0 an empty list)."""
    if store is None or len(nodes) < 2:
        gather(store, f"{key}/ports", rank, world, [])
        return []
    listener = None
    if rank in nodes:
        listener = socket.socket()
        listener.bind(("0.0.0.0", 0))
        listener.listen(len(nodes))
        store.set(f"{key}/port/{rank}", json.dumps([_my_address(master_addr), listener.getsockname()[1]]))
    results = []
    if rank in nodes:
        for peer in nodes:
            if peer == rank:
                continue
            addr, port = json.loads(store.get(f"{key}/port/{peer}"))
            try:
                with socket.create_connection((addr, port), timeout=3):
                    results.append({"from": rank, "to": peer, "address": f"{addr}:{port}", "ok": True})
            except OSError as e:
                results.append(
                    {"from": rank, "to": peer, "address": f"{addr}:{port}", "ok": False, "error": e.strerror or str(e)}
                )
    if listener is not None:
        # a node done with its peers keeps its port open until every node has tried it:
        # closing at once refuses the nodes still connecting (the more nodes, the more often)
        barrier(store, f"{key}/ports-tried", rank, len(nodes))
        listener.close()
    everyone = gather(store, f"{key}/ports", rank, world, results)
    return [r for rs in everyone or [] for r in rs]


def _my_address(master: str) -> str:
    """This node's address as the master sees it (the one that routes to the master; under
    srun the master comes from SLURM's node list, not MASTER_ADDR)."""
    from ..environments import network

    try:
        return network.source_address_for(network.resolve(master))
    except OSError:
        return "127.0.0.1"


def measure_allreduce(rt: Any, nodes: list[int], iters: int) -> dict[str, Any]:
    """Backend all-reduces: all ranks, then every pair of nodes (their first ranks)."""
    import torch
    import torch.distributed as dist

    out: dict[str, Any] = {"all": _time_allreduce(rt, None, iters)}
    if 1 < len(nodes) <= PAIR_LIMIT:
        pairs = []
        for i, a in enumerate(nodes):
            for b in nodes[i + 1 :]:
                group = dist.new_group([a, b])  # collective: every rank creates every group
                if rt.rank in (a, b):
                    pairs.append({"ranks": [a, b], **_time_allreduce(rt, group, iters)})
                dist.barrier()
        gathered: list[Any] = [None] * rt.world_size
        dist.all_gather_object(gathered, [p for p in pairs if p["ranks"][0] == rt.rank])
        out["pairs"] = [p for ps in gathered for p in ps]
    del torch
    return out


def _time_allreduce(rt: Any, group: Any, iters: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    n = dist.get_world_size(group)
    res: dict[str, Any] = {}
    for label, numel in (("latency_us", 1), ("busbw_gbps", 4 << 20)):
        t = torch.ones(numel, dtype=torch.float32, device=rt.device)
        dist.all_reduce(t, group=group)  # warm-up, and the check that it works at all
        expect = float(n)
        if abs(float(t[0]) - expect) > 1e-3:
            raise RuntimeError(f"all-reduce returned {float(t[0])}, expected {expect}")
        _sync(rt)
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t, group=group)
        _sync(rt)
        s = (time.perf_counter() - t0) / iters
        res[label] = round(s * 1e6, 1) if label == "latency_us" else round(numel * 4 / s * 2 * (n - 1) / n / 1e9, 3)
    return res


def _sync(rt: Any) -> None:
    import torch

    if rt.device.type == "cuda":
        torch.cuda.synchronize(rt.device)


# -- the command ------------------------------------------------------------------------------------
def main_check(cfg: Any, as_json: bool = False) -> int:
    """`ddpkit check`: start this node's workers like `ddpkit train` would (or be one of them
    under srun/torchrun), print rank 0's table; 0 only when a job would run."""
    from ..environments import DistEnv
    from ..launchers.elastic import run_elastic
    from ..launchers.plan import make_launch_plan
    from ..run.train import resolve_nproc
    from ..runtime import default_threads, resolve_backend, resolve_device_type

    run_dir = cfg.run_dir or "runs"
    env = DistEnv.detect()
    if env.outside_launcher:  # a worker of srun / torchrun: a key that every rank derives alike
        key = (
            os.environ.get("SLURM_JOB_ID")
            or os.environ.get("TORCHELASTIC_RUN_ID")
            or f"{env.master_addr}-{env.master_port}"
        )
    else:  # ddpkit starts the workers: one key for all of them (multi-node: the rendezvous id, below)
        key = cfg.rdzv_id or uuid.uuid4().hex[:12]
    spec = {
        "device": cfg.device,
        "backend": cfg.backend,
        "timeout": cfg.timeout,
        "threads": cfg.threads,
        "run_dir": run_dir,
        "key": "".join(c if c.isalnum() or c in "-_." else "-" for c in key),
    }
    if env.outside_launcher:
        result = check_worker(spec)
    else:
        device_type = resolve_device_type(cfg.device)
        resolve_backend(cfg.backend, device_type)
        nproc = resolve_nproc(cfg.nproc, device_type)
        plan = make_launch_plan(cfg, nproc, device_type, True, cfg.threads or default_threads(nproc))
        if not cfg.rdzv_id and (cfg.multi_node or cfg.rdzv_endpoint):
            spec["key"] = plan.rdzv_id  # the same on every node
        results = run_elastic(plan, check_worker, [spec], verbose=cfg.verbose)
        result = results.get(0) if 0 in results else next(iter(results.values()))
    if "facts" not in result:  # not rank 0: rank 0 (or its node's launcher) prints the table
        if env.outside_launcher:
            return 0 if result["ok"] else 1
        print(
            f"ddpkit check: rank {result['rank']}: "
            + (
                "a job would run (rank 0 prints the table)"
                if result["ok"]
                else "a job would NOT run (rank 0 prints why)"
            ),
            flush=True,
        )
        return 0 if result["ok"] else 1
    print(json.dumps(result, indent=1) if as_json else format_check(result), flush=True)
    sys.stdout.flush()
    return 0 if result["ok"] else 1
