"""scripts/gpu_check.py's checks on ddpkit run directories: summary.json, model.pt,
metrics.jsonl, checkpoints/. Each cmd_NAME returns the one line it found when the check holds
and raises Failed with the reason otherwise; torch is imported only by the checks that read
tensors. `python scripts/gpu_check_runs.py NAME ARGS...` runs one in a process of its own
(the bfloat16 question, which would start CUDA in the caller), printing its line, exit 0 or 1."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def arch(name):
    """The built-in tasks' models as the README describes them (model.pt must load into them)."""
    from torch import nn

    if name == "wine":
        return nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 3))
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # digits
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 2 * 2, 10),
    )


class Failed(Exception):
    """A check that does not hold; its message says what was found instead."""


def fail(msg):
    raise Failed(msg)


def summary(run):
    p = Path(run) / "summary.json"
    if not p.is_file():
        fail(f"{p} is missing")
    return json.loads(p.read_text())


def model(run):
    import torch

    p = Path(run) / "model.pt"
    if not p.is_file():
        fail(f"{p} is missing")
    return torch.load(p, weights_only=True, map_location="cpu")


def cmd_summary(run, *conds):
    """key=value (as JSON or text), key!=value, key>=number, key<=number on summary.json."""
    s = summary(run)
    bad = []
    for c in conds:
        m = re.fullmatch(r"([\w]+)(>=|<=|!=|=)(.*)", c)
        key, op, want = m.groups()
        have = s.get(key)
        text = have if isinstance(have, str) else json.dumps(have)
        if op == "=":
            ok = text == want
        elif op == "!=":
            ok = text != want
        else:
            ok = isinstance(have, (int, float)) and (have >= float(want) if op == ">=" else have <= float(want))
        if not ok:
            bad.append(f"{key} is {text}, expected {op if op != '=' else ''}{want}")
    peak = s.get("peak_memory_bytes") or [0]
    acc = s.get("eval_accuracy")
    info = (
        f"world {s.get('world_size')}, backend {s.get('backend')}, device {s.get('device')}, {s.get('strategy')}/"
        f"{s.get('precision')}, grad sync {s.get('grad_sync')}, epochs {s.get('epochs_done')}, "
        f"accuracy {acc if acc is None else format(acc, '.4f')}, train loss {s.get('train_loss') or 0:.4f}, "
        f"train {s.get('train_s') or 0:.2f} s, {s.get('samples_per_s') or 0:,.0f} samples/s, "
        f"peak {max(peak) / 2**20:.1f} MiB ({s.get('peak_memory_kind')})"
    )
    if bad:
        fail("; ".join(bad) + f"  [{info}]")
    return info


def cmd_peak(run, kind):
    s = summary(run)
    peak = s.get("peak_memory_bytes") or []
    if s.get("peak_memory_kind") != kind or not peak or min(peak) <= 0:
        fail(f"peak memory {peak} ({s.get('peak_memory_kind')}), expected > 0 ({kind})")
    state = (s.get("state_bytes_per_rank") or {}).get("total", 0)
    return f"peak {max(peak) / 2**20:.1f} MiB per rank ({kind}); model state {state / 2**20:.2f} MiB per rank"


def cmd_model(run, name):
    """model.pt: a plain state_dict on the CPU, finite, without `module.`, loading into the task's model."""
    import torch

    state = model(run)
    if not isinstance(state, dict) or not state:
        fail(f"model.pt is not a state_dict: {type(state).__name__}")
    if any(k.startswith(("module.", "_orig_mod.", "_fsdp")) for k in state):
        fail(f"wrapper prefixes in model.pt keys: {sorted(state)[:3]}")
    if any(v.device.type != "cpu" for v in state.values()):
        fail("model.pt holds tensors that are not on the CPU")
    if not all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point()):
        fail("model.pt holds NaN/inf")
    arch(name).load_state_dict(state)  # strict: every key, every shape
    return (
        f"{len(state)} tensors, {sum(v.numel() for v in state.values()):,} values, load into the {name} model (strict)"
    )


def _pair(a, b):
    x, y = model(a), model(b)
    if x.keys() != y.keys():
        fail(f"different keys: {sorted(set(x) ^ set(y))[:4]}")
    return x, y


def _maxdiff(x, y):
    return max((x[k].double() - y[k].double()).abs().max().item() for k in x)


def cmd_equal(a, b):
    import torch

    x, y = _pair(a, b)
    differ = [k for k in x if not torch.equal(x[k], y[k])]
    if differ:
        fail(f"{len(differ)} of {len(x)} tensors differ (first {differ[:3]}), max abs diff {_maxdiff(x, y):.3g}")
    return f"all {len(x)} tensors bit-identical (torch.equal)"


def cmd_close(a, b, rtol, atol):
    import torch

    x, y = _pair(a, b)
    rtol, atol = float(rtol), float(atol)
    d = _maxdiff(x, y)
    same = all(torch.equal(x[k], y[k]) for k in x)
    bad = [k for k in x if not torch.allclose(x[k], y[k], rtol=rtol, atol=atol)]
    text = "bit-identical" if same else f"max abs diff {d:.3g}"
    if bad:
        fail(f"{text}: {bad[:3]} outside rtol {rtol:g} / atol {atol:g}")
    return f"{text} (allowed rtol {rtol:g}, atol {atol:g})"


def cmd_acc_close(a, b, tol):
    x, y = summary(a).get("eval_accuracy"), summary(b).get("eval_accuracy")
    if x is None or y is None or abs(x - y) > float(tol):
        fail(f"accuracy {x} vs {y}: more than {tol} apart")
    return f"accuracy {x:.4f} vs {y:.4f} (within {tol})"


def cmd_metrics_equal(a, b):
    keep = ("epoch", "train_loss", "eval_loss")

    def rows(run):
        lines = (Path(run) / "metrics.jsonl").read_text().splitlines()
        return [{k: r.get(k) for k in keep} for r in map(json.loads, lines)]

    x, y = rows(a), rows(b)
    if x != y:
        first = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
        fail(
            f"metrics.jsonl differ ({len(x)} vs {len(y)} lines), first at line {first + 1}: "
            f"{x[first] if first < len(x) else None} vs {y[first] if first < len(y) else None}"
        )
    return f"{len(x)} epochs of train/eval loss identical"


def cmd_ckpts(run, *names):
    have = sorted(p.name for p in (Path(run) / "checkpoints").iterdir() if not p.name.startswith("."))
    if have != sorted(names):
        fail(f"checkpoints/ holds {have}, expected {sorted(names)}")
    return "checkpoints/: " + ", ".join(have)


def cmd_env(path, mode):
    r = json.loads(Path(path).read_text())
    v, d, plan = r["versions"], r["devices"], r["plan"]
    bad = []
    if mode == "gpu":
        bad += [] if v.get("cuda") else ["torch is a CPU build"]
        bad += [] if v.get("nccl") else ["NCCL not available"]
        bad += [] if d.get("gpus") else ["no GPU listed"]
        want = ("cuda", "nccl")
    else:
        bad += [] if v.get("gloo") else ["gloo not available"]
        want = ("cpu", "gloo")
    if (plan.get("device"), plan.get("backend")) != want:
        bad.append(
            f"ddpkit train would use {plan.get('device')}/{plan.get('backend')} (expected {want[0]}/{want[1]}): "
            f"{plan.get('error', '')}"
        )
    gpus = ", ".join(f"cuda:{g['index']} {g['name']} {g['memory_gib']} GiB" for g in d.get("gpus", [])) or "no GPU"
    info = (
        f"torch {v['torch']}, CUDA {v.get('cuda')}, cuDNN {v.get('cudnn')}, NCCL {v.get('nccl')}; {gpus}; "
        f"plan {plan.get('device')}/{plan.get('backend')}; warnings: {len(r.get('warnings', []))}"
    )
    if bad:
        fail("; ".join(bad) + f"  [{info}]")
    return info


def cmd_bf16(mode):
    """yes/no: does this hardware compute bfloat16 natively (what ddpkit's README promises to require)?"""
    import torch

    if mode == "gpu":
        ok = torch.cuda.get_device_capability(0) >= (8, 0)
    else:
        cpu = torch.cpu
        ok = bool(
            getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
            or getattr(cpu, "_is_amx_tile_supported", lambda: False)()
        )
    return "yes" if ok else "no"


def _mfu_text(m):
    return "-" if m is None else f"{100 * m:.3g}%"


def cmd_mfu(*runs):
    """The highest MFU (summary.json's throughput.mfu) among these runs, with its run; "-" when none has one."""
    best = None
    for r in runs:
        p = Path(r) / "summary.json"
        m = (json.loads(p.read_text()).get("throughput") or {}).get("mfu") if p.is_file() else None
        if m is not None and (best is None or m > best[0]):
            best = (m, Path(r).name)
    return "-" if best is None else f"{_mfu_text(best[0])} {best[1]}"


def cmd_gpt(path):
    """benchmarks/gpt_mfu.py's runs: every row measured; each ddpkit row's samples/s and MFU (ddpkit's own)."""
    r = json.loads(Path(path).read_text())
    runs = r.get("runs") or []
    bad = [f"{x['name']}: {str(x.get('error', ''))[:300]}" for x in runs if not x.get("ok")]
    if bad or not runs:
        fail("; ".join(bad) or "no runs")
    sps = {x["name"]: x.get("steady_samples_per_s") for x in runs}
    parts = []
    for x in runs:
        if x["name"].startswith("ddpkit"):
            hand = sps.get("hw-" + x["name"].split("-", 1)[1])
            vs = f", {x['steady_samples_per_s'] / hand:.2f}x hand-written" if hand else ""
            parts.append(
                f"{x['name']}: {x['steady_samples_per_s']:,.1f} samples/s, MFU {_mfu_text(x.get('reported_mfu'))}{vs}"
            )
    return "; ".join(parts)


def cmd_gpt_mfu(path):
    """The MFU of ddpkit's fastest row (what the table's mfu column shows for the GPT step)."""
    runs = [
        x for x in json.loads(Path(path).read_text()).get("runs", []) if x["name"].startswith("ddpkit") and x.get("ok")
    ]
    best = max(runs, key=lambda x: x.get("reported_mfu") or 0, default=None)
    return "-" if best is None else f"{_mfu_text(best.get('reported_mfu'))} {best['name']}"


def cmd_collect(out, *runs):
    found = {
        Path(r).name: json.loads((Path(r) / "summary.json").read_text())
        for r in runs
        if (Path(r) / "summary.json").is_file()
    }
    Path(out).write_text(json.dumps(found, indent=1) + "\n")
    return f"{len(found)} summaries -> {out}"


def cmd_bench(path):
    r = json.loads(Path(path).read_text())
    runs = r["runs"]
    bad = [f"{x['name']}: {x.get('error', '')[:300]}" for x in runs if not x.get("ok")]
    med = {}
    for x in runs:
        if x.get("ok") and isinstance(x.get("steady_samples_per_s"), (int, float)) and x["steady_samples_per_s"] > 0:
            med.setdefault(x["name"], []).append(x["steady_samples_per_s"])
    names = sorted({x["name"] for x in runs})
    missing = [n for n in names if n not in med]
    if bad or missing or not runs:
        fail("; ".join(bad + [f"{n}: no steady samples/s" for n in missing]) or "no runs")
    m = {n: sorted(v)[len(v) // 2] for n, v in med.items()}
    parts = [
        f"{p}: ddpkit {m[f'ddpkit-{p}']:,.0f} vs hand-written {m[f'hw-ddp-{p}']:,.0f} samples/s "
        f"({m[f'ddpkit-{p}'] / m[f'hw-ddp-{p}']:.2f}x)"
        for p in ("fp32", "bf16")
    ]
    return "; ".join(parts) + f"; bf16/fp32 ddpkit {m['ddpkit-bf16'] / m['ddpkit-fp32']:.2f}x"


def cmd_shards(folder, mode):
    """A sharded checkpoint of 2 ranks: a shard per rank, every rank's RNG state (CUDA's on a GPU)."""
    import torch

    d = Path(folder)
    names = {p.name for p in d.iterdir()}
    if not {"__0_0.distcp", "__1_0.distcp"} <= names:
        fail(f"shards: {sorted(names)}")
    rng = torch.load(d / "ddpkit.pt", weights_only=True)["rng"]
    if len(rng) != 2:
        fail(f"{len(rng)} RNG states, expected 2")
    if mode == "gpu" and not all("cuda" in r and r["cuda"].numel() > 0 for r in rng):
        fail(f"no CUDA RNG state: {[sorted(r) for r in rng]}")
    return f"2 shards, RNG keys {sorted(rng[0])}"


def run(name, *args):
    """The check `name` on `args`: (holds, its line)."""
    try:
        return True, globals()["cmd_" + name](*args)
    except Failed as e:
        return False, str(e)
    except Exception as e:  # noqa: BLE001 - a file that is not what the check expects fails the check
        return False, f"{type(e).__name__}: {e}"


if __name__ == "__main__":
    ok, line = run(sys.argv[1], *sys.argv[2:])
    print(line)
    sys.exit(0 if ok else 1)
