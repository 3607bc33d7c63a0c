"""Small benchmark harness: run commands, time them from outside, parse their RESULT line,
interleave repeats, and report (markdown table, PNG bar chart).

A benchmarked command prints, anywhere in stdout or stderr, a line
    RESULT {"samples_per_s": ..., "train_s": ..., "wall_s": ..., "final_loss": ..., ...}
(JSON object; the last such line wins). Its "wall_s" (the in-process clock) is kept as
"inner_wall_s"; "wall_s" in a harness result is always measured from outside (process
start to exit, launchers and interpreter teardown included).

argv may use placeholders, filled per run: {python} (this interpreter), {tmp} (a fresh
temporary directory, deleted afterwards; BENCH_SAVE_DIR={tmp}/ckpt is also set), {port}
(a free TCP port), plus any keyword given in `subst`.

A variant may also name `collect`: a function called with the run's {tmp} directory before
it is deleted (only after a run that exited 0); the fields it returns are added to the
result, e.g. a figure read from the run directory of `ddpkit train --run-dir {tmp}/run`.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

T = TypeVar("T")
RESULT_RE = re.compile(r"RESULT (\{.*\})\s*$")
ALIASES = {"final_loss": "train_loss", "test_acc": "eval_accuracy"}  # ddpkit's summary names

# variables that would change what a launcher or script does; the harness removes them
# so that each variant runs with its own defaults (a variant may set them in its env)
_SCRUB = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OMP_WAIT_POLICY",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)
_SCRUB_PREFIXES = ("ACCELERATE_", "PL_", "LT_", "DDPKIT_")


def clean_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB and not k.startswith(_SCRUB_PREFIXES)}
    env["PYTHONUNBUFFERED"] = "1"
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


def parse_result(text: str) -> dict | None:
    found = None
    for line in text.splitlines():
        m = RESULT_RE.search(line)
        if m:
            try:
                found = json.loads(m.group(1))
            except json.JSONDecodeError:
                pass
    return found


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (small race until the command binds it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fill(s: str, mapping: dict) -> str:
    for k, v in mapping.items():
        s = s.replace("{" + k + "}", str(v))
    return s


def run_cmd(
    name: str,
    argv: list[str],
    env: dict | None = None,
    *,
    timeout: float = 600,
    cwd: str | None = None,
    log_dir: str | None = None,
    subst: dict | None = None,
    log_name: str | None = None,
    collect: Callable[[str], dict] | None = None,
) -> dict:
    """Run argv once; return a result dict (name, argv, rc, ok, wall_s, cpu_s, parsed RESULT fields).

    cpu_s is the user + system time of the whole process tree the command started (what a
    shared machine's load changes far less than the wall time). The run's {tmp} folder is
    removed whatever happens, an interrupt included."""
    tmp = tempfile.mkdtemp(prefix="bench_run_")
    try:
        mapping = {"python": sys.executable, "tmp": tmp, **(subst or {})}
        if any("{port}" in a for a in argv):
            mapping["port"] = free_port()
        argv = [_fill(a, mapping) for a in argv]
        full_env = clean_env({k: _fill(str(v), mapping) for k, v in (env or {}).items()})
        full_env.setdefault("BENCH_SAVE_DIR", os.path.join(tmp, "ckpt"))
        full_env["DDPKIT_LAUNCH_TIME"] = repr(time.time())  # ddpkit times its phases from here
        rc, out, err, wall, cpu = _launch(argv, full_env, cwd, timeout)
        collected, collect_error = {}, None
        if collect is not None and rc == 0:
            try:
                collected = collect(tmp)
            except Exception as e:  # noqa: BLE001 - a missing file is reported as this run's failure
                collect_error = f"collect: {type(e).__name__}: {e}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res = _result(name, argv, rc, out, err, wall, collected, collect_error)
    res["cpu_s"] = cpu
    if log_dir:
        _write_log(log_dir, log_name or name, argv, rc, wall, out, err)
    return res


def _launch(argv: list[str], env: dict, cwd: str | None, timeout: float) -> tuple[object, str, str, float, float]:
    """(rc or "timeout"/"oserror", stdout, stderr, wall s, CPU s of the children) of one command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    try:
        p = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
    except OSError as e:
        rc, out, err = "oserror", "", str(e)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return rc, out, err, wall, cpu


def _result(
    name: str, argv: list[str], rc: object, out: str, err: str, wall: float, collected: dict, collect_error: str | None
) -> dict:
    """The result dict of one run: its RESULT fields (wall_s kept as inner_wall_s), ok, error."""
    parsed = parse_result(out) or parse_result(err)
    if parsed is not None and collected:
        parsed = {**parsed, **collected}
    res = {"name": name, "argv": argv, "rc": rc, "wall_s": wall, "result": parsed}
    if parsed:
        for k, v in parsed.items():
            res["inner_wall_s" if k == "wall_s" else k] = v
        for k, alias in ALIASES.items():  # other tools' names for the same quantity
            if k not in res and alias in res:
                res[k] = res[alias]
    if isinstance(res.get("fit_end_s"), (int, float)):
        res["teardown_s"] = max(0.0, wall - res["fit_end_s"])  # fit done -> the command exited
    res["ok"] = rc == 0 and parsed is not None and collect_error is None
    if not res["ok"]:
        tail = (err or out).strip().splitlines()[-8:]
        res["error"] = (
            ("no RESULT line; " if parsed is None else "")
            + (f"{collect_error}; " if collect_error else "")
            + " | ".join(tail)[-800:]
        )
    return res


def _write_log(log_dir: str, name: str, argv: list[str], rc: object, wall: float, out: str, err: str) -> None:
    os.makedirs(log_dir, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    i = 0
    while os.path.exists(os.path.join(log_dir, f"{stem}.{i}.log")):
        i += 1
    with open(os.path.join(log_dir, f"{stem}.{i}.log"), "w") as f:
        f.write(f"$ {' '.join(argv)}\nrc={rc} wall_s={wall:.3f}\n--- stdout\n{out}\n--- stderr\n{err}\n")


def require(res: dict, what: str | None = None) -> dict:
    """res if its run succeeded; else stop the driver with what failed and the run's last lines."""
    if not res.get("ok"):
        raise SystemExit(f"{what or res['name']} failed (rc={res['rc']}): {res.get('error', '')}")
    return res


def interleave(variants: Sequence[T], rounds: int, *, mirror: bool = False) -> Iterator[tuple[int, T]]:
    """(round, variant) for `rounds` rounds, A B C A B C ..., so that slow drifts of a shared
    machine hit every variant alike; mirror: every other round backwards (A B C C B A ...),
    so that a machine getting busier or quieter within a round hits them alike too."""
    for r in range(rounds):
        for v in variants if not (mirror and r % 2) else list(variants)[::-1]:
            yield r, v


def alternate(variants: list[dict], repeats: int, *, log: Callable[[str], None] = print, **run_kw) -> list[dict]:
    """Run variants interleaved, A B C A B C ..., `repeats` rounds; returns every run's result.

    A variant is a dict with "name" and "argv", optionally "env", "timeout", "world_size"
    (expected; a run reporting another world size is marked failed) and any other keys,
    which are copied into its results (e.g. "workload").
    """
    out = []
    total = repeats * len(variants)
    for r, v in interleave(variants, repeats):
        kw = dict(run_kw)
        if "timeout" in v:
            kw["timeout"] = v["timeout"]
        log_name = f"{v['workload']}-{v['name']}" if v.get("workload") else v["name"]
        res = run_cmd(v["name"], v["argv"], v.get("env"), log_name=log_name, collect=v.get("collect"), **kw)
        res["repeat"] = r
        for k, val in v.items():
            if k not in ("name", "argv", "env", "collect") and k not in res:
                res[k] = val
        want = v.get("world_size")
        if res["ok"] and want is not None and res.get("world_size") != want:
            res["ok"] = False
            res["error"] = f"world size {res.get('world_size')} != expected {want}"
        out.append(res)
        log(_progress(res, len(out), total))
    return out


def _progress(res: dict, n: int, total: int) -> str:
    if not res["ok"]:
        return f"[{n}/{total}] {res['name']}: FAILED rc={res['rc']}: {res.get('error', '')[:300]}"
    extra = "".join(f" {k}={res[k]:.4g}" for k in ("train_s", "samples_per_s") if isinstance(res.get(k), (int, float)))
    return f"[{n}/{total}] {res['name']}: wall {res['wall_s']:.2f}s{extra} (world {res.get('world_size')})"


# ---------------------------------------------------------------- reporting


def _groups(results: Iterable[dict]) -> OrderedDict[str, list[dict]]:
    g: OrderedDict[str, list[dict]] = OrderedDict()
    for r in results:
        g.setdefault(r["name"], []).append(r)
    return g


def _vals(runs: list[dict], key: str) -> list[float]:
    return [r[key] for r in runs if r.get("ok") and isinstance(r.get(key), (int, float))]


def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    a = abs(x)
    if a >= 1000:
        return f"{x:,.0f}"
    if a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def _cell(v: list[float]) -> str:
    if not v:
        return "-"
    med = statistics.median(v)
    if len(v) == 1:
        return _fmt(med)
    return f"{_fmt(med)} ({_fmt(min(v))}-{_fmt(max(v))})"


def spread(values: list[float], fmt: str) -> str:
    """median (min-max) of values, each formatted with fmt (e.g. ".2f"): a driver's table cell."""
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def md_table(head: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """The lines of a markdown table: the head, its rule, one line per row (cells as str())."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join(map(str, row)) + " |" for row in rows
    ]


_LABELS = {
    "wall_s": "wall s",
    "train_s": "train s",
    "samples_per_s": "samples/s",
    "startup_s": "startup s",
    "fit_s": "fit s",
    "teardown_s": "teardown s",
    "steady_samples_per_s": "steady samples/s",
    "final_loss": "final loss",
    "test_acc": "test acc",
    "inner_wall_s": "in-process s",
}


def _paired_cell(runs: list[dict], twin: list[dict], metric: str) -> str:
    """median(runs) / median(twin), then the min-max of the round-by-round ratios."""
    mv, tv = _vals(runs, metric), _vals(twin, metric)
    if not mv or not tv or not statistics.median(tv):
        return "-"
    by_round = {r.get("repeat"): r[metric] for r in twin if r.get("ok") and isinstance(r.get(metric), (int, float))}
    per = [
        r[metric] / by_round[r.get("repeat")]
        for r in runs
        if r.get("ok") and isinstance(r.get(metric), (int, float)) and by_round.get(r.get("repeat"))
    ]
    cell = f"{statistics.median(mv) / statistics.median(tv):.3f}x"
    return cell + (f" ({min(per):.3f}-{max(per):.3f})" if len(per) > 1 else "")


def table(
    results: list[dict],
    baselines: list[str] = (),
    *,
    metric: str = "wall_s",
    columns: list[str] = (
        "wall_s",
        "startup_s",
        "fit_s",
        "train_s",
        "teardown_s",
        "samples_per_s",
        "steady_samples_per_s",
        "final_loss",
        "test_acc",
    ),
    paired_suffix: str = "",
) -> str:
    """Markdown table: one row per variant (in first-seen order) with median (min-max) of
    each column over its successful runs, and median(metric) / median(metric of baseline)
    for each named baseline. With paired_suffix (e.g. "@baseline"), one more column: each
    variant NAME that has a NAME+paired_suffix twin gets median(NAME) / median(twin), and in
    brackets the min-max of the same ratio taken round by round (repeat r against repeat r)."""
    groups = _groups(results)
    cols = [c for c in columns if any(_vals(runs, c) for runs in groups.values())]
    base_med = {}
    for b in baselines:
        v = _vals(groups.get(b, []), metric)
        if v:
            base_med[b] = statistics.median(v)
    head = (
        ["variant", "procs", "ok/runs"]
        + [_LABELS.get(c, c) for c in cols]
        + [f"{_LABELS.get(metric, metric)} ÷ {b}" for b in base_med]
    )
    paired = bool(paired_suffix) and any(n + paired_suffix in groups for n in groups)
    if paired:
        head.append(f"{_LABELS.get(metric, metric)} ÷ same variant {paired_suffix} (per round)")
    rows = []
    for name, runs in groups.items():
        ok = [r for r in runs if r.get("ok")]
        procs = sorted({r.get("world_size") for r in ok if r.get("world_size") is not None})
        row = [name, ",".join(map(str, procs)) or "-", f"{len(ok)}/{len(runs)}"]
        row += [_cell(_vals(runs, c)) for c in cols]
        mv = _vals(runs, metric)
        for _name, bm in base_med.items():
            row.append(f"{statistics.median(mv) / bm:.2f}x" if mv and bm else "-")
        if paired:
            row.append(_paired_cell(runs, groups.get(name + paired_suffix, []), metric))
        rows.append(row)
    lines = md_table(head, rows)
    fails = [r for r in results if not r.get("ok")]
    for r in fails:
        lines.append(f"\nFAILED {r['name']} (repeat {r.get('repeat')}): rc={r['rc']} {r.get('error', '')[:400]}")
    return "\n".join(lines)


def device_name(device: str) -> str:
    """The device a benchmark ran on, for its report's header."""
    import torch

    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        return f"{p.name} ({round(p.total_memory / 2**30)} GiB, compute capability {p.major}.{p.minor})"
    return f"CPU, {len(os.sched_getaffinity(0))} usable cores"


def machine(device: str) -> str:
    """When, on what device, with which python and torch (and CUDA) a report was measured."""
    import platform

    import torch

    cuda = f", CUDA {torch.version.cuda}" if device == "cuda" else ""
    return (
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}; {device_name(device)}; python {platform.python_version()}, "
        f"torch {torch.__version__}{cuda}"
    )


def measured(load_before: Sequence[float], load_after: Sequence[float]) -> str:
    """When and on what a report's figures were measured, and how busy the machine was."""
    return (
        f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {os.cpu_count()} cores (shared), load average "
        f"{load_before[0]:.1f} before and {load_after[0]:.1f} after"
    )


def plot(results: list[dict], path: str, metrics: dict | None = None, title: str | None = None) -> str | None:
    """PNG bar chart, one panel per workload (result["workload"], else one panel).
    metrics: {workload: "wall_s" | "samples_per_s" | ...}; default wall_s. For wall_s the
    bar is split into training (median train_s) and everything else; whiskers are min-max.
    Drawn by ddpkit.reporting.plot.plot_bars, the code behind `ddpkit plot`. Without
    matplotlib: one line saying the plot is skipped, and None (the results stand without it)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"plot skipped: matplotlib is not installed (pip install matplotlib to draw {path})", flush=True)
        return None
    try:
        from ddpkit.reporting.plot import plot_bars
    except ImportError:  # run from a checkout without ddpkit installed
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
        from ddpkit.reporting.plot import plot_bars

    metrics = metrics or {}
    by_wl: OrderedDict[str, list[dict]] = OrderedDict()
    for r in results:
        by_wl.setdefault(r.get("workload", ""), []).append(r)
    panels: OrderedDict[str, list[dict]] = OrderedDict()
    xlabels = {}
    for wl, rs in by_wl.items():
        metric = metrics.get(wl, "wall_s")
        bars = []
        for name, runs in _groups(rs).items():
            v = _vals(runs, metric)
            if not v:
                continue
            bar = {"name": name, "median": statistics.median(v), "min": min(v), "max": max(v)}
            if metric == "wall_s":
                train = _vals(runs, "train_s")
                bar["part"] = statistics.median(train) if train else 0.0
            bars.append(bar)
        panels[wl] = bars
        xlabels[wl] = f"{_LABELS.get(metric, metric)} (median, whiskers min-max)"
    return str(plot_bars(panels, path, xlabels=xlabels, title=title))
