"""`ddpkit bench`: does DDP pay off on this machine, for this task?

Two measurements, each at every requested process count:
  allreduce  all-reduce time across message sizes, for the backend and, where it applies,
             ddpkit's shared-memory gradient path, reported the way nccl-tests does:
             algbw = bytes / time, busbw = algbw x 2(n-1)/n (what each link carries in a
             ring), and the latency of the smallest message.
  step       the task's training step split into data (fetching the batch), compute
             (forward + backward + optimizer with DDP's gradient sync switched off:
             no_sync), and communication (the same steps with sync, minus compute: the
             part of the all-reduce that backward does not hide). All three are timed, none
             estimated. Scaling efficiency = samples/s at n / (n x samples/s at 1).
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any, Iterator

DEFAULT_SIZES = "4,1K,64K,1M,16M"


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in "KMG" else text
    value = int(float(number) * mult)
    if value < 4:
        raise ValueError(text)
    return value


def parse_nprocs(text: str) -> list[int]:
    out = sorted({int(v) for v in text.split(",") if v.strip()})
    if not out or out[0] < 1:
        raise ValueError(text)
    return out


def bench_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """In every worker: run the requested measurements; rank 0's result is the report."""
    from ..environments import DistEnv
    from ..runtime import Runtime

    env = DistEnv.detect()
    with Runtime(env, spec["device"], spec["backend"], spec["timeout"], spec["threads"]) as rt:
        out: dict[str, Any] = {
            "world_size": rt.world_size,
            "backend": rt.backend if env.distributed else "none",
            "device": str(rt.device),
            "threads": _threads(),
        }
        if "allreduce" in spec["what"] and rt.world_size > 1:
            out["allreduce"] = _allreduce(rt, spec["sizes"], spec["iters"])
            if _shm_applies(rt, spec):
                out["allreduce_shm"] = _allreduce(rt, spec["sizes"], spec["iters"], shm=True)
        if "step" in spec["what"]:
            out["step"] = _step(rt, spec)
    return out


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _shm_applies(rt: Any, spec: dict[str, Any]) -> bool:
    from ..runtime.shm import why_not_shm

    return (
        spec.get("grad_sync", "auto") != "backend"
        and why_not_shm(rt.world_size, rt.env.local_world_size, rt.backend, rt.device.type) is None
    )


def _allreduce(rt: Any, sizes: list[int], iters: int, shm: bool = False) -> list[dict[str, float]]:
    """Time per all-reduce for each message size (mean of `iters` back to back, slowest
    rank), through the backend or (shm) through ddpkit's shared-memory path, which
    computes the mean (a division folded into its copy)."""
    import torch
    import torch.distributed as dist

    n = rt.world_size
    rows = []
    shm_state = None
    if shm:
        from ..runtime.shm import ShmAllReduce

        shm_state = ShmAllReduce.create(max(1, max(sizes) // 4), timeout=rt.timeout)
    for size in sizes:
        count = max(1, size // 4)
        t = torch.ones(count, dtype=torch.float32, device=rt.device)
        reduce = (
            (lambda t=t: shm_state.all_reduce_mean_(t)) if shm_state is not None else (lambda t=t: dist.all_reduce(t))
        )
        for _ in range(3):
            reduce()
        # as nccl-tests: `iters` operations back to back after one barrier, the mean per
        # operation on the slowest rank (timing each op after its own barrier would measure
        # how unevenly ranks leave the barrier: ~0.2 ms with gloo here)
        dist.barrier()
        _sync(rt.device)
        t0 = time.perf_counter()
        for _ in range(iters):
            reduce()
        _sync(rt.device)
        worst = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=rt.device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        sec = worst.item()
        algbw = count * 4 / sec / 1e9
        rows.append(
            {
                "size": count * 4,
                "count": count,
                "time_us": sec * 1e6,
                "algbw_gbs": algbw,
                "busbw_gbs": algbw * 2 * (n - 1) / n,
            }
        )
    return rows


def _step(rt: Any, spec: dict[str, Any]) -> dict[str, float]:
    """Median per-step times of data, compute (no_sync) and sync steps, slowest rank."""
    import torch
    from torch import nn

    from ..config import RunConfig
    from ..data import ShardedLoader
    from ..data.placement import tensors_of
    from ..strategies import grad_sync_used, wrap_model
    from ..strategies.optimizers import make_optimizer
    from ..task import build_task

    torch.manual_seed(0)
    task = build_task(spec["task"], RunConfig(task=spec["task"], batch_size=spec["batch_size"]))
    loss_fn = task.loss_fn or nn.CrossEntropyLoss()
    model = task.model.to(rt.device)
    optimizer = make_optimizer(task.optimizer, model, None)
    ddp = wrap_model(model, rt, spec.get("grad_sync", "auto"))
    used = grad_sync_used(ddp)
    workers_apply = tensors_of(task.train_set) is None  # the loader's workers fetch map-style samples
    loader = ShardedLoader(task.train_set, spec["batch_size"], rt.rank, rt.world_size, seed=0)
    result = _time_steps(rt, ddp, optimizer, loss_fn, _timed_batches(loader), spec["steps"])
    med = _slowest_medians(rt, result)
    del ddp, optimizer, model, task
    return {**_step_figures(med, used, spec["batch_size"], rt.world_size), "workers_apply": workers_apply}


def _timed_batches(loader: Any) -> Iterator[tuple[Any, float]]:
    """The loader's steps, pass after pass without end, each with the seconds it took to get."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        it = loader.iter_steps()
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                break
            yield item, time.perf_counter() - t0
        epoch += 1


def _time_steps(
    rt: Any, ddp: Any, optimizer: Any, loss_fn: Any, source: Iterator[tuple[Any, float]], steps: int, warmup: int = 3
) -> dict[str, list[float]]:
    """This rank's seconds per data fetch, sync step and no_sync step, `steps` of each after `warmup`."""
    import contextlib

    import torch.distributed as dist

    from ..training.batches import first_tensor, to_device

    result: dict[str, list[float]] = {"data": [], "sync": [], "nosync": []}
    # sync and no_sync steps alternate, so a drift of a shared machine hits both alike;
    # with one process there is nothing to sync: every step is compute
    modes = ["sync", "nosync"] if rt.world_size > 1 else ["sync"]
    for i in range(warmup * len(modes) + steps * len(modes)):
        mode = modes[i % len(modes)]
        (batch, n_local, _), data_s = next(source)
        if rt.world_size > 1:
            dist.barrier()  # every rank starts the step together: times are the step's own
        _sync(rt.device)
        t0 = time.perf_counter()
        ctx = ddp.no_sync() if mode == "nosync" and hasattr(ddp, "no_sync") else contextlib.nullcontext()
        with ctx:
            *inputs, target = to_device(batch, rt.device)
            out = ddp(*inputs)
            if n_local:
                loss_fn(out, target).backward()
            else:
                (first_tensor(out).sum() * 0.0).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(rt.device)
        step_s = time.perf_counter() - t0
        if i >= warmup * len(modes):
            result[mode].append(step_s)
            if mode == "sync":
                result["data"].append(data_s)
    if rt.world_size == 1:
        result["nosync"] = result["sync"]
    return result


def _slowest_medians(rt: Any, result: dict[str, list[float]]) -> dict[str, float]:
    """Each kind's median, the slowest rank's (every rank takes part)."""
    import torch
    import torch.distributed as dist

    med = {}
    for key, values in result.items():
        v = torch.tensor(values, dtype=torch.float64, device=rt.collective_device)
        if rt.world_size > 1:
            dist.all_reduce(v, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        med[key] = statistics.median(v.tolist())
    return med


def _step_figures(med: dict[str, float], used: Any, batch_size: int, world_size: int) -> dict[str, Any]:
    """A step split into data, compute and communication, in ms and shares, and its throughput."""
    data = med["data"]
    compute = min(med["nosync"], med["sync"])  # on a busy machine the sync median can come out lower: no comm then
    comm = med["sync"] - compute  # so data + compute + comm is the step, always
    step = data + med["sync"]
    return {
        "grad_sync": used,
        "batch_size": batch_size,
        "global_batch": batch_size * world_size,
        "step_ms": step * 1e3,
        "data_ms": data * 1e3,
        "compute_ms": compute * 1e3,
        "comm_ms": comm * 1e3,
        "samples_per_s": batch_size * world_size / step,
        "data_share": data / step,
        "compute_share": compute / step,
        "comm_share": comm / step,
    }


def run_bench(spec: dict[str, Any], nprocs: list[int], clean_parent: bool = True) -> list[dict[str, Any]]:
    """Run bench_worker at each process count on this node; rank 0's result of each."""
    from ..launchers.elastic import LaunchPlan, run_elastic, start_method_for
    from ..runtime import default_threads, resolve_device_type

    device_type = resolve_device_type(spec["device"])
    results = []
    for n in nprocs:
        threads = spec["threads"] or default_threads(n)
        plan = LaunchPlan(
            nproc_per_node=n,
            start_method=start_method_for("auto", device_type, clean_parent),
            timeout=spec["timeout"],
            threads_per_process=threads,
        )
        out = run_elastic(plan, bench_worker, [{**spec, "threads": threads}])
        results.append(out.get(0) if isinstance(out, dict) else out[0])
    return results


def format_report(results: list[dict[str, Any]], spec: dict[str, Any]) -> str:
    lines = []
    ar = [r for r in results if r.get("allreduce")]
    for r in ar:
        for key, what in (
            ("allreduce", f"backend {r['backend']}"),
            ("allreduce_shm", "ddpkit's shared memory (mean; the gradient path of CPU ranks on one machine)"),
        ):
            if not r.get(key):
                continue
            lines += [
                f"# all-reduce (float32): {r['world_size']} processes, {what}, device {r['device']}, "
                f"mean of {spec['iters']} back to back (slowest rank)",
                f"# {'nproc':>5} {'size_B':>12} {'count':>10} {'time_us':>10} {'algbw_GB/s':>11} {'busbw_GB/s':>11}",
            ]
            for row in r[key]:
                lines.append(
                    f"  {r['world_size']:>5} {row['size']:>12} {row['count']:>10} {row['time_us']:>10.1f} "
                    f"{row['algbw_gbs']:>11.4g} {row['busbw_gbs']:>11.4g}"
                )
            lines.append(
                f"# latency (smallest message): {r[key][0]['time_us']:.1f} us; "
                f"peak busbw {max(x['busbw_gbs'] for x in r[key]):.3g} GB/s"
            )
            lines.append("")
    if not ar and "allreduce" in spec["what"]:
        lines += ["# all-reduce: needs at least 2 processes (--nproc 1,2)", ""]
    st = [r for r in results if r.get("step")]
    if st:
        base = next((r["step"]["samples_per_s"] for r in st if r["world_size"] == 1), None)
        lines += [
            f"# step time: task {spec['task']}, batch {spec['batch_size']} per process, "
            f"median of {spec['steps']} steps "
            "(slowest rank); compute = step with no_sync, comm = sync step - compute, data = batch fetch",
            f"# {'nproc':>5} {'threads':>7} {'sync':>5} {'samples/s':>10} "
            f"{'step_ms':>9} {'data_ms':>8} {'compute_ms':>10} "
            f"{'comm_ms':>8} {'data%':>6} {'compute%':>8} {'comm%':>6} {'efficiency':>10}",
        ]
        for r in st:
            s = r["step"]
            eff = f"{s['samples_per_s'] / (r['world_size'] * base):.2f}" if base else "-"
            lines.append(
                f"  {r['world_size']:>5} {r['threads']:>7} {s.get('grad_sync', '-'):>5} "
                f"{s['samples_per_s']:>10.1f} {s['step_ms']:>9.3f} "
                f"{s['data_ms']:>8.3f} {s['compute_ms']:>10.3f} {s['comm_ms']:>8.3f} {100 * s['data_share']:>6.1f} "
                f"{100 * s['compute_share']:>8.1f} {100 * s['comm_share']:>6.1f} {eff:>10}"
            )
        if base:
            best = max(st, key=lambda r: r["step"]["samples_per_s"])
            verdict = "DDP pays off" if best["world_size"] > 1 else "one process is fastest here: DDP does not pay off"
            lines.append(
                f"# fastest: {best['world_size']} process(es), "
                f"{best['step']['samples_per_s']:.0f} samples/s ({verdict})"
            )
        advice = bench_advice(results)
        if advice:
            lines += ["# to try (ddpkit train), from the fastest row's split:", *(f"#   {a}" for a in advice)]
    return "\n".join(lines)


def bench_advice(results: list[dict[str, Any]]) -> list[str]:
    """The performance doctor (reporting/advice.py) on the fastest row's step split: what a
    benchmark measures (no optimizer split, no GPU-busy share, no memory) fires no other rule."""
    from ..reporting.advice import Measured, advise

    st = [r for r in results if r.get("step")]
    if not st:
        return []
    best = max(st, key=lambda r: r["step"]["samples_per_s"])
    s = best["step"]
    return advise(
        Measured(
            data_s=s["data_ms"] / 1e3,
            compute_s=s["compute_ms"] / 1e3,
            grad_sync_s=s["comm_ms"] / 1e3,
            world_size=best["world_size"],
            num_workers=0 if s.get("workers_apply") else None,  # the benchmark's loader has none
            cores_per_process=best.get("threads"),
        )
    )


def main_bench(ns: Any) -> int:
    from ..errors import DdpkitError

    try:
        nprocs = parse_nprocs(ns.nproc)
    except ValueError:
        raise DdpkitError(
            f"--nproc must be a comma-separated list of positive integers, e.g. 1,2; got {ns.nproc!r}"
        ) from None
    try:
        sizes = sorted({parse_size(s) for s in ns.sizes.split(",") if s.strip()})
    except (ValueError, IndexError):
        raise DdpkitError(f"--sizes must be byte counts of at least 4 like 4,1K,1M; got {ns.sizes!r}") from None
    what = [w.strip() for w in ns.what.split(",") if w.strip()]
    if not what or any(w not in ("allreduce", "step") for w in what):
        raise DdpkitError(f"--what must be allreduce, step or both (allreduce,step); got {ns.what!r}")
    for flag, value in (("--iters", ns.iters), ("--steps", ns.steps), ("--batch-size", ns.batch_size)):
        if value < 1:
            raise DdpkitError(f"{flag} must be a positive integer, got {value}")
    if ns.threads is not None and ns.threads < 1:
        raise DdpkitError(f"--threads must be a positive integer, got {ns.threads}")
    if "step" in what:
        from ..task import load_task_function

        load_task_function(ns.task)  # a clear error now, not in every worker
    spec = {
        "what": what,
        "sizes": sizes,
        "iters": ns.iters,
        "steps": ns.steps,
        "task": ns.task,
        "batch_size": ns.batch_size,
        "device": ns.device,
        "backend": ns.backend,
        "timeout": ns.timeout,
        "threads": ns.threads,
        "grad_sync": ns.grad_sync,
    }
    results = run_bench(spec, nprocs)
    print(format_report(results, spec), flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"spec": spec, "results": results, "advice": bench_advice(results)}, f, indent=1)
    return 0
