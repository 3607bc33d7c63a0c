#!/usr/bin/env bash
# gpu_check.sh: run and check ddpkit's GPU path on a machine with one GPU (or more), in one go.
#
#   bash scripts/gpu_check.sh                # on the GPU machine, from anywhere (it cd's to the repo root)
#   bash scripts/gpu_check.sh --cpu          # the very same steps on CPU (gloo, --device cpu): a dry run
#   bash scripts/gpu_check.sh --steps 2,7    # only some steps (a step that needs the Wine reference runs it)
#
# Nothing is downloaded or installed: ddpkit comes from this checkout (PYTHONPATH=REPO/src),
# torch, numpy and scikit-learn from the interpreter: $PYTHON if set, else `python3` (with
# --cpu: this checkout's .venv/bin/python when it exists). Only ddpkit's CLI is used
# (`python -m ddpkit env|train`), plus benchmarks/gpu.py for step 8; the checks read the run
# directories' files (summary.json, model.pt, metrics.jsonl, checkpoints/) with torch alone.
#
# Steps (each one continues after a failed check; the table at the end says which failed):
#   1 env       ddpkit env: CUDA device, NCCL, the plan (nccl + cuda)
#   2 train     Wine (100 epochs) and digits (8 epochs) with --nproc 1: device cuda:0, the CPU
#               tests' accuracy thresholds (>= 0.97, >= 0.95), the run contract; Wine again
#               through torch's elastic agent (--max-restarts 1: a spawned worker, the path of
#               multi-GPU runs), equal to the in-process run
#   3 bf16      --precision bf16 (autocast) trains, accuracy within 0.05 of fp32 (refused where
#               the hardware has no native bfloat16, which is then what is checked)
#   4 fsdp      --strategy fsdp with one process is refused (exit 2, one line); with 2 or more
#               devices (2 GPUs, or --cpu) FSDP2 on 2 processes trains, model.pt loads, equals DDP
#   5 fused     the default (--fused-optimizer auto) fused the optimizer on the GPU (summary
#               fused_optimizer; not on a CPU); --fused-optimizer off trains, close to it
#   6 compile   --compile trains, close to eager
#   7 resume    50 epochs, then --resume --epochs 100: model.pt bit-identical to 100 straight
#               epochs (torch.equal on every tensor), same per-epoch losses
#   7b resume-cnn  the same for the digits CNN (cuDNN convolutions) under --deterministic (summary
#               deterministic true), with a control run when it differs
#   8 bench     benchmarks/gpu.py: the MLP, hand-written DDP vs ddpkit, fp32 and bf16, samples/s
#               -> benchmarks/results/gpu.md (with --cpu: only into the output folder)
#   9 fp16      --precision fp16 (autocast + gradient scaler) trains, accuracy within 0.05 of
#               fp32, and 50 epochs + --resume is bit-identical to 100 (the scaler's state is in
#               the checkpoint); with --cpu its refusal is what is checked
#  10 syncdebug scripts/sync_check.py: ddpkit's optimizer steps (--accumulate 2, batches copied
#               ahead by training/prefetch.py, then batches of a data set kept on the device over
#               two passes, the default fused AdamW) under torch.cuda.set_sync_debug_mode("error"):
#               fails on any host synchronisation inside a step; none is allowed (0 a step: the
#               device skips a non-finite step, the host reads the agreement a step later; with
#               --cpu: the same steps, no debug mode)
#  11 sharegpu  DDPKIT_SHARE_GPU=1: 2 ranks share cuda:0 over gloo: DDP and FSDP2 (CUDA DTensors) on
#               2 ranks end at a 1-rank run; FSDP's sharded checkpoint of CUDA tensors holds every
#               rank's CUDA RNG state and resumes at world 1 to the 1-rank run (with --cpu: the same
#               runs on CPU ranks). Not proved: NCCL itself, P2P/NVLink, multi-GPU bandwidth
#  8b gpt       benchmarks/gpt_mfu.py: GPT-2 small (block 256) in ddpkit and a hand-written loop,
#               bf16 + torch.compile + fused AdamW, with each row's MFU; run last, sized to the
#               time left: the fp32 eager rows too when there is time, the compiled rows left
#               uncompiled when there is not (with --cpu: a tiny GPT's bf16 rows, uncompiled, MFU
#               against a nominal peak of GPU_CHECK_CPU_PEAK_TFLOPS, 1 by default: the wiring, not
#               a measurement). Its table goes into gpu.md
#
# The table at the end has an mfu column: each step's highest model FLOPs utilisation among its
# ddpkit runs (summary.json's throughput.mfu; "-" where none has one: no FLOP count or no known
# peak), and for 8b ddpkit's compiled row's.
#
# With one process ddpkit starts no process group (summary backend "none", as on CPU): NCCL
# and DDP are exercised only with 2+ GPUs (step 4's 2-process runs) and by the hand-written
# baseline of step 8 (NCCL with world size 1).
#
# Output: $OUT if set (what comes back from the GPU machine: at most 8 files), else
# runs/gpu_check[-cpu]/ of this checkout: gpu_check.log (everything, every benchmark's own
# logs merged in), gpu_check_table.txt, env.json, summaries.json, bench.json, gpu.md (the MLP
# and the GPT tables). Run directories and other work files go to a temporary folder.
# Time: at most 8 minutes on one H100/H200 (GPU_CHECK_HARD_S, 460 s, ends every command; no
# step starts after GPU_CHECK_BUDGET_S, 400 s).
# Exit 0: every step passed; 1: some step failed; 2: cannot run (no GPU without --cpu, no torch).
#
# Determinism (step 7): CUBLAS_WORKSPACE_CONFIG=:4096:8 is exported for every training run
# unless already set: the value torch's reproducibility notes named for deterministic cuBLAS
# (torch 2.11 no longer insists on it, pytorch#161749; cuBLAS is run-to-run reproducible on
# one stream anyway, and Wine's Linear layers and Adam use nothing else). Step 7b trains the
# digits CNN with --deterministic (deterministic cuDNN without benchmark mode,
# torch.use_deterministic_algorithms, ddpkit's own CUBLAS_WORKSPACE_CONFIG in each worker); if
# the resumed model still differs, it runs it twice uninterrupted to tell a resume bug from
# run-to-run differences that --deterministic failed to remove.
set -uo pipefail

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; }

MODE=gpu
ONLY="1,2,3,4,5,6,7,7b,8,9,10,11,8b"
while [[ $# -gt 0 ]]; do
  case $1 in
    --cpu) MODE=cpu ;;
    --steps) [[ $# -ge 2 ]] || { echo "gpu_check: --steps needs a list, e.g. 2,7" >&2; exit 2; }; ONLY=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
  shift
done

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
if [[ -z ${PYTHON:-} ]]; then
  if [[ $MODE == cpu && -x $REPO/.venv/bin/python ]]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

OUTDIR=${OUT:-$REPO/runs/gpu_check$([[ $MODE == cpu ]] && echo -cpu)}
mkdir -p "$OUTDIR" || exit 2
LOG=$OUTDIR/gpu_check.log
: > "$LOG"
say() { printf '%s\n' "$*" | tee -a "$LOG"; }   # console and log
note() { printf '%s\n' "$*" >> "$LOG"; }        # log only

# ---------------------------------------------------------------- is there a GPU (or --cpu)?
probe=$("$PYTHON" -c '
import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(torch.__version__, torch.version.cuda or "none", n)' 2>&1)
if [[ $? -ne 0 ]]; then
  say "gpu_check: cannot import torch with $PYTHON: ${probe##*$'\n'}"
  say "gpu_check: set PYTHON to an interpreter that has torch (no package is installed by this script)"
  exit 2
fi
read -r TORCH_VERSION TORCH_CUDA NGPU <<< "${probe##*$'\n'}"
if [[ $MODE == gpu && $NGPU -lt 1 ]]; then
  say "gpu_check: no CUDA GPU is visible to $PYTHON (torch $TORCH_VERSION, CUDA build: $TORCH_CUDA)."
  say "gpu_check: this script checks ddpkit's GPU path and needs a GPU; run it on a GPU machine,"
  say "gpu_check: or pass --cpu to run the same steps on the CPU (a dry run of this script)."
  exit 2
fi

if [[ $MODE == gpu ]]; then
  DEV=cuda BACKEND=nccl EXPECT_DEVICE=cuda:0 PEAK_KIND="cuda max allocated" NDEV=$NGPU
  BENCH_BATCH=${GPU_CHECK_BENCH_BATCH:-4096} BENCH_STEPS=${GPU_CHECK_BENCH_STEPS:-30} BENCH_ROUNDS=${GPU_CHECK_BENCH_ROUNDS:-1}
  BENCH_MD=$REPO/benchmarks/results/gpu.md
  # GPT-2 small at block 256 (the first run's notes: ~2,200 samples/s compiled on an H200, ~1 min
  # of compilation a compiled row), 2 passes of GPT_STEPS steps of batch GPT_BATCH a row
  GPT_SHAPE=(--block-size 256) GPT_BATCH=${GPU_CHECK_GPT_BATCH:-32} GPT_STEPS=${GPU_CHECK_GPT_STEPS:-20} GPT_PEAK=()
  BUDGET_S=${GPU_CHECK_BUDGET_S:-400} HARD_S=${GPU_CHECK_HARD_S:-460}
else
  DEV=cpu BACKEND=gloo EXPECT_DEVICE=cpu PEAK_KIND="peak resident set" NDEV=2
  BENCH_BATCH=${GPU_CHECK_BENCH_BATCH:-64} BENCH_STEPS=${GPU_CHECK_BENCH_STEPS:-4} BENCH_ROUNDS=${GPU_CHECK_BENCH_ROUNDS:-1}
  BENCH_MD=$OUTDIR/gpu.md
  GPT_SHAPE=(--n-layer 2 --n-head 2 --n-embd 32 --block-size 32 --vocab-size 128) GPT_BATCH=2 GPT_STEPS=3
  GPT_PEAK=(--peak-tflops "${GPU_CHECK_CPU_PEAK_TFLOPS:-1}")
  BUDGET_S=${GPU_CHECK_BUDGET_S:-1500} HARD_S=${GPU_CHECK_HARD_S:-2400}
fi
# Time: no step starts after BUDGET_S seconds, no command runs past HARD_S (GPU: well inside
# the 10 minutes one device command may take), and one ddpkit command at most CMD_TIMEOUT.
CMD_TIMEOUT=${GPU_CHECK_CMD_TIMEOUT:-240}
# Reproducible cuBLAS (torch's reproducibility notes ask for it with deterministic algorithms);
# set here, not inherited, so that step 8 can leave it out (it measures the defaults).
SET_CUBLAS=0
if [[ -z ${CUBLAS_WORKSPACE_CONFIG:-} ]]; then export CUBLAS_WORKSPACE_CONFIG=:4096:8; SET_CUBLAS=1; fi
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# One node, no network: NCCL's bootstrap socket on loopback (it falls back to lo anyway when it
# finds no other interface; naming it avoids picking an interface that is down).
[[ $MODE == gpu ]] && export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/ddpkit-gpu-check.XXXXXX") || exit 2
mkdir -p "$WORK/out"
START=$SECONDS
limit() {  # limit SECONDS: that, or less when the hard deadline is nearer
  local want=$1 left=$(( HARD_S - (SECONDS - START) ))
  (( left < want )) && want=$left
  echo "$want"
}
tmo() {  # tmo SECONDS CMD...: CMD under a time limit (exit 124 when it ran out)
  local s=$1; shift
  if (( s < 5 )); then echo "gpu_check: no time left (GPU_CHECK_HARD_S=$HARD_S) for: $*"; return 124; fi
  if command -v timeout > /dev/null; then timeout -k 10 "$s" "$@"; else "$@"; fi
}

# ---------------------------------------------------------------- the checks (torch only)
cat > "$WORK/checks.py" <<'PYCHECKS'
"""Checks on ddpkit run directories: summary.json, model.pt, metrics.jsonl, checkpoints/.
Each subcommand prints one line and exits 0 when the check holds, 1 (with the reason) otherwise.
torch is imported only by the subcommands that read tensors (an import costs a second or two)."""
import json
import re
import sys
from pathlib import Path


def arch(name):
    """The built-in tasks' models as the README describes them (model.pt must load into them)."""
    from torch import nn

    if name == "wine":
        return nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 3))
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # digits
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 2 * 2, 10))


def fail(msg):
    print(msg)
    sys.exit(1)


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
    info = (f"world {s.get('world_size')}, backend {s.get('backend')}, device {s.get('device')}, {s.get('strategy')}/"
            f"{s.get('precision')}, grad sync {s.get('grad_sync')}, epochs {s.get('epochs_done')}, "
            f"accuracy {acc if acc is None else format(acc, '.4f')}, train loss {s.get('train_loss') or 0:.4f}, "
            f"train {s.get('train_s') or 0:.2f} s, {s.get('samples_per_s') or 0:,.0f} samples/s, "
            f"peak {max(peak) / 2**20:.1f} MiB ({s.get('peak_memory_kind')})")
    if bad:
        fail("; ".join(bad) + f"  [{info}]")
    print(info)


def cmd_peak(run, kind):
    s = summary(run)
    peak = s.get("peak_memory_bytes") or []
    if s.get("peak_memory_kind") != kind or not peak or min(peak) <= 0:
        fail(f"peak memory {peak} ({s.get('peak_memory_kind')}), expected > 0 ({kind})")
    state = (s.get("state_bytes_per_rank") or {}).get("total", 0)
    print(f"peak {max(peak) / 2**20:.1f} MiB per rank ({kind}); model state {state / 2**20:.2f} MiB per rank")


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
    print(f"{len(state)} tensors, {sum(v.numel() for v in state.values()):,} values, load into the {name} model (strict)")


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
    print(f"all {len(x)} tensors bit-identical (torch.equal)")


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
    print(f"{text} (allowed rtol {rtol:g}, atol {atol:g})")


def cmd_acc_close(a, b, tol):
    x, y = summary(a).get("eval_accuracy"), summary(b).get("eval_accuracy")
    if x is None or y is None or abs(x - y) > float(tol):
        fail(f"accuracy {x} vs {y}: more than {tol} apart")
    print(f"accuracy {x:.4f} vs {y:.4f} (within {tol})")


def cmd_metrics_equal(a, b):
    keep = ("epoch", "train_loss", "eval_loss")
    rows = lambda run: [{k: r.get(k) for k in keep} for r in map(json.loads, (Path(run) / "metrics.jsonl").read_text().splitlines())]  # noqa: E731
    x, y = rows(a), rows(b)
    if x != y:
        first = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        fail(f"metrics.jsonl differ ({len(x)} vs {len(y)} lines), first at line {first + 1}: "
             f"{x[first] if first < len(x) else None} vs {y[first] if first < len(y) else None}")
    print(f"{len(x)} epochs of train/eval loss identical")


def cmd_ckpts(run, *names):
    have = sorted(p.name for p in (Path(run) / "checkpoints").iterdir() if not p.name.startswith("."))
    if have != sorted(names):
        fail(f"checkpoints/ holds {have}, expected {sorted(names)}")
    print("checkpoints/: " + ", ".join(have))


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
        bad.append(f"ddpkit train would use {plan.get('device')}/{plan.get('backend')} (expected {want[0]}/{want[1]}): "
                   f"{plan.get('error', '')}")
    gpus = ", ".join(f"cuda:{g['index']} {g['name']} {g['memory_gib']} GiB" for g in d.get("gpus", [])) or "no GPU"
    info = (f"torch {v['torch']}, CUDA {v.get('cuda')}, cuDNN {v.get('cudnn')}, NCCL {v.get('nccl')}; {gpus}; "
            f"plan {plan.get('device')}/{plan.get('backend')}; warnings: {len(r.get('warnings', []))}")
    if bad:
        fail("; ".join(bad) + f"  [{info}]")
    print(info)


def cmd_bf16(mode):
    """yes/no: does this hardware compute bfloat16 natively (what ddpkit's README promises to require)?"""
    import torch

    if mode == "gpu":
        ok = torch.cuda.get_device_capability(0) >= (8, 0)
    else:
        cpu = torch.cpu
        ok = bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)() or getattr(cpu, "_is_amx_tile_supported", lambda: False)())
    print("yes" if ok else "no")


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
    print("-" if best is None else f"{_mfu_text(best[0])} {best[1]}")


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
            parts.append(f"{x['name']}: {x['steady_samples_per_s']:,.1f} samples/s, MFU {_mfu_text(x.get('reported_mfu'))}{vs}")
    print("; ".join(parts))


def cmd_gpt_mfu(path):
    """The MFU of ddpkit's fastest row (what the table's mfu column shows for the GPT step)."""
    runs = [x for x in json.loads(Path(path).read_text()).get("runs", []) if x["name"].startswith("ddpkit") and x.get("ok")]
    best = max(runs, key=lambda x: x.get("reported_mfu") or 0, default=None)
    print("-" if best is None else f"{_mfu_text(best.get('reported_mfu'))} {best['name']}")


def cmd_collect(out, *runs):
    found = {Path(r).name: json.loads((Path(r) / "summary.json").read_text()) for r in runs if (Path(r) / "summary.json").is_file()}
    Path(out).write_text(json.dumps(found, indent=1) + "\n")
    print(f"{len(found)} summaries -> {out}")


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
    parts = [f"{p}: ddpkit {m[f'ddpkit-{p}']:,.0f} vs hand-written {m[f'hw-ddp-{p}']:,.0f} samples/s "
             f"({m[f'ddpkit-{p}'] / m[f'hw-ddp-{p}']:.2f}x)" for p in ("fp32", "bf16")]
    print("; ".join(parts) + f"; bf16/fp32 ddpkit {m['ddpkit-bf16'] / m['ddpkit-fp32']:.2f}x")


if __name__ == "__main__":
    globals()["cmd_" + sys.argv[1]](*sys.argv[2:])
PYCHECKS
pycheck() { "$PYTHON" "$WORK/checks.py" "$@"; }

# ---------------------------------------------------------------- helpers
declare -a ROWS=()
SEP=$'\x1f'  # between the fields of a table row (notes may hold anything printable)
STEP_OK=1
STEP_NOTE=""
STEP_MFU=""       # the step's mfu column (set by the step, else the best of STEP_RUNS)
declare -a STEP_RUNS=()  # the run directories the step trained
add_note() { [[ -n ${*// /} ]] && STEP_NOTE="${STEP_NOTE:+$STEP_NOTE; }$*"; return 0; }

# run_ddpkit LABEL ARGS...: python -m ddpkit ARGS from the repo root; output into the log and
# $WORK/out/LABEL.txt; returns the exit code (a non-zero one prints the last lines).
run_ddpkit() {
  local label=$1; shift
  local out=$WORK/out/$label.txt t0=$SECONDS rc s
  s=$(limit "$CMD_TIMEOUT")
  note "\$ $PYTHON -m ddpkit $*"
  tmo "$s" "$PYTHON" -m ddpkit "$@" > "$out" 2>&1
  rc=$?
  cat "$out" >> "$LOG"
  note "(exit $rc after $((SECONDS - t0)) s)"
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then say "  $label: stopped after its time limit (${s} s)"; fi
  if [[ $rc -ne 0 ]]; then
    say "  $label: ddpkit exited $rc; its last lines:"
    tail -n 12 "$out" | sed 's/^/      | /'
  fi
  return $rc
}

# check DESCRIPTION CMD...: run CMD; "ok" or "FAIL" with its output; a failure fails the step.
check() {
  local desc=$1; shift
  local out rc
  out=$("$@" 2>&1)
  rc=$?
  LAST=$out
  if [[ $rc -eq 0 ]]; then
    say "  ok    $desc${out:+: ${out//$'\n'/ | }}"
  else
    STEP_OK=0
    say "  FAIL  $desc"
    printf '%s\n' "$out" | sed 's/^/        /' | tee -a "$LOG"
  fi
  return $rc
}
trained() {  # trained LABEL RUNDIR ARGS...: a training run whose exit code is itself a check
  local label=$1 run=$2; shift 2
  STEP_RUNS+=("$run")
  check "$label trains (exit 0)" run_ddpkit "$label" train "$@" --run-dir "$run" --progress lines
}
grep_out() { grep -q -- "$2" "$WORK/out/$1.txt" || { echo "'$2' not in the output of $1"; return 1; }; }
no_traceback() { ! grep -q Traceback "$WORK/out/$1.txt" || { echo "a traceback in the output of $1"; return 1; }; }
exit_code_is() {  # exit_code_is WANT LABEL ARGS...: run ddpkit, pass when it exits WANT
  local want=$1 label=$2 rc; shift 2
  run_ddpkit "$label" "$@" > /dev/null; rc=$?
  [[ $rc -eq $want ]] || { echo "exit $rc, expected $want"; tail -n 5 "$WORK/out/$label.txt"; return 1; }
  echo "exit $rc: $(grep -m1 'ddpkit: error\|error:' "$WORK/out/$label.txt" | cut -c1-160)"
}

# DEVICE FLAGS: what every training run of this mode gets
D=(--nproc 1 --device "$DEV" --backend "$BACKEND")
W="$WORK/runs"
mkdir -p "$W"
WINE=(wine "${D[@]}" --epochs 100 --seed 0)      # the CPU tests' default job (100 epochs, batch 32)
DIGITS=(digits "${D[@]}" --epochs 8 --seed 0 --batch-size 64 --save-every 0)  # test_digits.py's 1-process run

wine_ref() {  # the fp32 Wine reference of steps 3, 5, 6, 7 (step 2 makes it; made here when step 2 is skipped)
  [[ -f $W/wine-fp32/model.pt ]] && return 0
  say "  (making the fp32 Wine reference run)"
  run_ddpkit wine-fp32 train "${WINE[@]}" --run-dir "$W/wine-fp32" --progress lines > /dev/null
}

step() {  # step ID NAME FUNCTION
  local id=$1 name=$2 fn=$3 t0=$SECONDS status
  [[ ",$ONLY," == *",$id,"* ]] || return 0
  STEP_OK=1
  STEP_NOTE=""
  STEP_MFU=""
  STEP_RUNS=()
  if (( SECONDS - START > BUDGET_S )); then
    say "== step $id $name: not run, the time budget (${BUDGET_S} s) is spent"
    ROWS+=("$id$SEP$name${SEP}FAIL${SEP}0$SEP-${SEP}not run: time budget of ${BUDGET_S} s spent (GPU_CHECK_BUDGET_S)")
    return 0
  fi
  say ""
  say "== step $id $name ($(date +%T), $((SECONDS - START)) s into the run)"
  "$fn"
  status=$([[ $STEP_OK -eq 1 ]] && echo PASS || echo FAIL)
  [[ -z $STEP_MFU && ${#STEP_RUNS[@]} -gt 0 ]] && STEP_MFU=$(pycheck mfu "${STEP_RUNS[@]}" 2>/dev/null | cut -d' ' -f1)
  say "== step $id $name: $status ($((SECONDS - t0)) s${STEP_MFU:+, mfu $STEP_MFU})"
  ROWS+=("$id$SEP$name$SEP$status$SEP$((SECONDS - t0))$SEP${STEP_MFU:--}$SEP$STEP_NOTE")
}

# ---------------------------------------------------------------- the steps
step_env() {
  check "ddpkit env exits 0" run_ddpkit env-text env
  if run_ddpkit env-json env --json > /dev/null; then cp "$WORK/out/env-json.txt" "$OUTDIR/env.json"; fi
  check "ddpkit env --json: device, backend, versions" pycheck env "$OUTDIR/env.json" "$MODE" \
    && add_note "$(cut -d';' -f1-2 <<< "$LAST")"
  sed -n '/^warnings/,$p' "$WORK/out/env-text.txt" | sed 's/^/  env: /'
}

step_train() {
  local r=$W/wine-fp32
  if trained wine-fp32 "$r" "${WINE[@]}"; then
    check "summary: one process on $EXPECT_DEVICE, accuracy >= 0.97" pycheck summary "$r" world_size=1 backend=none \
      device="$EXPECT_DEVICE" strategy=ddp precision=fp32 epochs_done=100 eval_accuracy'>='0.97 data="on device"
    check "printed summary names the device" grep_out wine-fp32 "world size   1 (1 node), backend none, device $EXPECT_DEVICE"
    check "model.pt: plain state_dict, loads into Linear(13,64)-ReLU-Linear(64,3)" pycheck model "$r" wine
    check "checkpoints at epochs 50 and 100" pycheck ckpts "$r" epoch-000050.pt epoch-000100.pt
    check "peak memory measured on every rank ($PEAK_KIND)" pycheck peak "$r" "$PEAK_KIND"
  fi
  # the spawned-worker path (torch's elastic agent; what every multi-GPU run takes)
  if trained wine-agent "$W/wine-agent" "${WINE[@]}" --save-every 0 --max-restarts 1; then
    check "elastic-agent worker: $EXPECT_DEVICE, accuracy >= 0.97" pycheck summary "$W/wine-agent" world_size=1 \
      device="$EXPECT_DEVICE" eval_accuracy'>='0.97
    [[ -f $r/model.pt ]] && check "elastic-agent run equals the in-process run" pycheck close "$W/wine-agent" "$r" 0 1e-6
  fi
  if trained digits-fp32 "$W/digits-fp32" "${DIGITS[@]}"; then
    check "digits summary: $EXPECT_DEVICE, accuracy >= 0.95" pycheck summary "$W/digits-fp32" world_size=1 \
      device="$EXPECT_DEVICE" epochs_done=8 eval_accuracy'>='0.95
    check "digits model.pt loads into the CNN" pycheck model "$W/digits-fp32" digits
  fi
  [[ -f $r/summary.json ]] && add_note "$(pycheck summary "$r" 2>/dev/null | cut -d, -f3,7 | sed 's/^ *//')"
  [[ $MODE == gpu ]] && add_note "1 process: no process group (backend none), NCCL unused"
  return 0
}

step_bf16() {
  local has
  has=$(pycheck bf16 "$MODE" 2>&1)
  if [[ $has != yes ]]; then
    add_note "no native bfloat16 here: the refusal is checked"
    check "--precision bf16 refused with exit 2 and one line" exit_code_is 2 wine-bf16 train "${WINE[@]}" --precision bf16 \
      --save-every 0 --run-dir "$W/wine-bf16"
    check "the refusal names bfloat16" grep_out wine-bf16 "--precision bf16: this"
    check "no traceback" no_traceback wine-bf16
    return 0
  fi
  wine_ref
  if trained wine-bf16 "$W/wine-bf16" "${WINE[@]}" --precision bf16 --save-every 0; then
    check "wine bf16: precision bf16, accuracy >= 0.97" pycheck summary "$W/wine-bf16" precision=bf16 \
      device="$EXPECT_DEVICE" eval_accuracy'>='0.97
    check "wine bf16 accuracy within 0.05 of fp32" pycheck acc_close "$W/wine-bf16" "$W/wine-fp32" 0.05
    check "wine bf16 weights close to fp32 (bf16 rounding, same training)" pycheck close "$W/wine-bf16" "$W/wine-fp32" 0 0.1 \
      && add_note "weights $(cut -d'(' -f1 <<< "$LAST")vs fp32"
  fi
  [[ -f $W/digits-fp32/model.pt ]] || run_ddpkit digits-fp32 train "${DIGITS[@]}" --run-dir "$W/digits-fp32" > /dev/null
  if trained digits-bf16 "$W/digits-bf16" "${DIGITS[@]}" --precision bf16; then
    check "digits bf16: accuracy >= 0.95" pycheck summary "$W/digits-bf16" precision=bf16 eval_accuracy'>='0.95
    check "digits bf16 accuracy within 0.05 of fp32" pycheck acc_close "$W/digits-bf16" "$W/digits-fp32" 0.05
  fi
}

step_fsdp() {
  check "--strategy fsdp with one process: exit 2, one line" exit_code_is 2 fsdp-1 train wine "${D[@]}" --strategy fsdp \
    --epochs 1 --run-dir "$W/fsdp-1"
  check "the refusal says it needs 2 processes" grep_out fsdp-1 "needs at least 2"
  check "no traceback, no model.pt" bash -c "! grep -q Traceback '$WORK/out/fsdp-1.txt' && [[ ! -e '$W/fsdp-1/model.pt' ]]"
  if [[ $NDEV -lt 2 ]]; then
    add_note "1 GPU: FSDP needs 2 processes, one per GPU, so FSDP2 itself is not exercised (refusal checked)"
    return 0
  fi
  local common=(wine --nproc 2 --device "$DEV" --backend "$BACKEND" --epochs 20 --seed 0 --save-every 10)
  local sync=$([[ $MODE == gpu ]] && echo nccl || echo shm)
  if trained ddp-2 "$W/ddp-2" "${common[@]}"; then
    check "DDP on 2 processes: backend $BACKEND, gradients by $sync" pycheck summary "$W/ddp-2" world_size=2 \
      backend="$BACKEND" grad_sync="$sync" strategy=ddp
  fi
  if trained fsdp-2 "$W/fsdp-2" "${common[@]}" --strategy fsdp; then
    check "FSDP on 2 processes: backend $BACKEND" pycheck summary "$W/fsdp-2" world_size=2 backend="$BACKEND" strategy=fsdp
    check "FSDP model.pt: consolidated, loads into the Wine model" pycheck model "$W/fsdp-2" wine
    check "sharded checkpoints at epochs 10 and 20" pycheck ckpts "$W/fsdp-2" epoch-000010 epoch-000020
    [[ -f $W/ddp-2/model.pt ]] && check "FSDP ends at DDP's parameters (1e-5/1e-6, as tests/distributed/test_fsdp.py)" \
      pycheck close "$W/fsdp-2" "$W/ddp-2" 1e-5 1e-6
  fi
  add_note "FSDP2 and DDP on 2 processes ($BACKEND)"
}

step_fused() {
  wine_ref
  local fused=$([[ $MODE == gpu ]] && echo true || echo false)  # --fused-optimizer auto: GPUs only
  check "--fused-optimizer auto (the default): fused_optimizer $fused (fused on a GPU only)" pycheck summary "$W/wine-fp32" fused_optimizer=$fused
  if trained wine-unfused "$W/wine-unfused" "${WINE[@]}" --fused-optimizer off --save-every 0; then
    check "--fused-optimizer off: not fused, accuracy >= 0.97" pycheck summary "$W/wine-unfused" fused_optimizer=false \
      eval_accuracy'>='0.97
    check "fused (the default) close to unfused after 100 epochs" pycheck close "$W/wine-fp32" "$W/wine-unfused" 1e-4 1e-5
    add_note "$(cut -d'(' -f1 <<< "$LAST")vs unfused"
  fi
}

step_compile() {
  wine_ref
  local cc
  cc=$(command -v cc || command -v gcc || command -v clang || echo none)
  note "C compiler (inductor/triton need one): $cc"
  if trained wine-compile "$W/wine-compile" "${WINE[@]}" --compile --save-every 0; then
    check "compiled: accuracy >= 0.97" pycheck summary "$W/wine-compile" device="$EXPECT_DEVICE" eval_accuracy'>='0.97
    local took
    took=$(grep -o 'train [0-9.]* s' <<< "$LAST")
    check "compiled close to eager after 100 epochs" pycheck close "$W/wine-compile" "$W/wine-fp32" 1e-3 1e-4
    add_note "$(cut -d'(' -f1 <<< "$LAST")vs eager; ${took#train } of training, compilation included"
  else
    [[ $cc == none ]] && add_note "no C compiler on PATH: inductor/triton need one"
    # what torch.compile on a GPU needs besides torch: triton, and a C compiler with Python's headers
    # (triton builds its launcher with them); name the first such complaint
    add_note "$(grep -m1 -E "Python\.h|stddef\.h|C compiler|[Tt]riton (installation )?not found|No module named 'triton'|BackendCompilerFailed" \
      "$WORK/out/wine-compile.txt" | cut -c1-200)"
  fi
}

step_resume() {
  wine_ref
  local r=$W/wine-split
  trained wine-half "$r" "${WINE[@]}" --epochs 50 || return 0
  if trained wine-resume "$r" "${WINE[@]}" --resume; then
    check "resumed from the epoch-50 checkpoint" grep_out wine-resume "resuming from .*epoch-000050.pt"
    check "model.pt bit-identical to 100 uninterrupted epochs" pycheck equal "$r" "$W/wine-fp32"
    check "per-epoch train/eval losses identical" pycheck metrics_equal "$r" "$W/wine-fp32"
  fi
  add_note "CUBLAS_WORKSPACE_CONFIG=$CUBLAS_WORKSPACE_CONFIG"
}

step_resume_cnn() {
  local common=(digits "${D[@]}" --epochs 4 --seed 0 --batch-size 64 --save-every 2 --deterministic)
  trained cnn-full "$W/cnn-full" "${common[@]}" || return 0
  trained cnn-half "$W/cnn-split" "${common[@]}" --epochs 2 || return 0
  trained cnn-resume "$W/cnn-split" "${common[@]}" --resume || return 0
  check "--deterministic recorded in the summary" pycheck summary "$W/cnn-split" deterministic=true
  add_note "digits CNN --deterministic: 2 epochs + --resume to 4 vs 4"
  if pycheck equal "$W/cnn-split" "$W/cnn-full" > /dev/null 2>&1; then
    check "CNN resumed model.pt bit-identical to 4 uninterrupted epochs" pycheck equal "$W/cnn-split" "$W/cnn-full"
    return 0
  fi
  # not equal: is the CNN reproducible at all here (two uninterrupted runs)?
  trained cnn-full2 "$W/cnn-full2" "${common[@]}" || return 0
  if pycheck equal "$W/cnn-full2" "$W/cnn-full" > /dev/null 2>&1; then
    check "CNN resumed model.pt bit-identical (uninterrupted runs are reproducible here, so resume broke it)" \
      pycheck equal "$W/cnn-split" "$W/cnn-full"
  else
    check "CNN resumed model.pt bit-identical" pycheck equal "$W/cnn-split" "$W/cnn-full"
    add_note "two uninterrupted CNN runs differ too, under --deterministic: a kernel it did not make deterministic"
  fi
}

step_bench() {
  local rc t0=$SECONDS pre=(env)
  [[ $SET_CUBLAS -eq 1 ]] && pre=(env -u CUBLAS_WORKSPACE_CONFIG)  # measure torch's defaults
  note "\$ $PYTHON benchmarks/gpu.py --device $DEV --batch-size $BENCH_BATCH --steps $BENCH_STEPS --rounds $BENCH_ROUNDS"
  tmo "$(limit 300)" "${pre[@]}" "$PYTHON" benchmarks/gpu.py --device "$DEV" --batch-size "$BENCH_BATCH" \
    --steps "$BENCH_STEPS" --rounds "$BENCH_ROUNDS" --out "$BENCH_MD" --json "$OUTDIR/bench.json" --logs "$WORK/bench-logs" \
    > "$WORK/out/bench.txt" 2>&1
  rc=$?
  cat "$WORK/out/bench.txt" >> "$LOG"
  cat "$WORK/bench-logs"/*.log >> "$LOG" 2>/dev/null
  note "(exit $rc after $((SECONDS - t0)) s)"
  sed -n '/^| variant/,/^$/p' "$WORK/out/bench.txt"
  check "benchmarks/gpu.py exits 0" test "$rc" -eq 0 || tail -n 15 "$WORK/out/bench.txt" | sed 's/^/      | /'
  [[ -f $BENCH_MD && $BENCH_MD != "$OUTDIR/gpu.md" ]] && cp "$BENCH_MD" "$OUTDIR/gpu.md"
  check "gpu.md written" test -s "$OUTDIR/gpu.md"
  check "every row measured (steady samples/s > 0)" pycheck bench "$OUTDIR/bench.json" && add_note "$LAST"
}

step_fp16() {
  if [[ $MODE == cpu ]]; then
    check "--precision fp16 refused on a CPU with exit 2" exit_code_is 2 wine-fp16 train "${WINE[@]}" --precision fp16 \
      --save-every 0 --run-dir "$W/wine-fp16"
    check "the refusal names the GPU it needs" grep_out wine-fp16 "--precision fp16 needs a CUDA GPU"
    check "no traceback" no_traceback wine-fp16
    add_note "CPU: the refusal is checked"
    return 0
  fi
  wine_ref
  if trained wine-fp16 "$W/wine-fp16" "${WINE[@]}" --precision fp16; then
    check "wine fp16: precision fp16, accuracy >= 0.97" pycheck summary "$W/wine-fp16" precision=fp16 \
      device="$EXPECT_DEVICE" eval_accuracy'>='0.97
    check "wine fp16 accuracy within 0.05 of fp32" pycheck acc_close "$W/wine-fp16" "$W/wine-fp32" 0.05
  fi
  local r=$W/wine-fp16-split
  trained wine-fp16-half "$r" "${WINE[@]}" --precision fp16 --epochs 50 || return 0
  if trained wine-fp16-resume "$r" "${WINE[@]}" --precision fp16 --resume; then
    check "fp16 resumed model.pt bit-identical to 100 uninterrupted epochs (scaler state restored)" pycheck equal "$r" "$W/wine-fp16"
  fi
}

step_syncdebug() {
  local out=$WORK/out/syncdebug.txt rc
  note "\$ $PYTHON scripts/sync_check.py --device $DEV --steps 20 --accumulate 2"
  tmo "$(limit 120)" "$PYTHON" scripts/sync_check.py --device "$DEV" --steps 20 --accumulate 2 > "$out" 2>&1
  rc=$?
  cat "$out" >> "$LOG"
  check "no host synchronisation inside a step (exit $rc)" test "$rc" -eq 0 || tail -n 8 "$out" | sed 's/^/      | /'
  [[ $MODE == gpu ]] && check "0 host syncs a step: the default fused AdamW, the device decides" \
    grep_out syncdebug "fused AdamW: the device decides, 0 host syncs a step"
  add_note "$(grep -m1 '^sync_check:' "$out" | cut -c1-200)"
  note "\$ $PYTHON scripts/sync_check.py --device $DEV --steps 20 --accumulate 2 --data-on-device"
  tmo "$(limit 120)" "$PYTHON" scripts/sync_check.py --device "$DEV" --steps 20 --accumulate 2 --data-on-device \
    > "$out.placed" 2>&1
  rc=$?
  cat "$out.placed" >> "$LOG"
  check "no host synchronisation with the data set on the device (exit $rc)" test "$rc" -eq 0 \
    || tail -n 8 "$out.placed" | sed 's/^/      | /'
}

step_sharegpu() {
  # The multi-rank CUDA paths on one GPU: ranks share it over gloo (collectives staged through host
  # memory), which NCCL refuses. What this cannot prove: NCCL itself (its kernels, algorithms,
  # watchdog), GPU-to-GPU P2P/NVLink, real multi-GPU bandwidth and overlap, one GPU per rank.
  local s=$W/share g=(wine --device "$DEV" --global-batch-size 64 --seed 0)
  local one=("${g[@]}" --nproc 1 --epochs 20 --save-every 0)
  trained share-1 "$s/one" "${one[@]}" || return 0
  if DDPKIT_SHARE_GPU=1 trained share-ddp "$s/ddp" "${g[@]}" --nproc 2 --epochs 20 --save-every 0; then
    check "DDP, 2 ranks on $EXPECT_DEVICE over gloo" pycheck summary "$s/ddp" world_size=2 backend=gloo \
      device="$EXPECT_DEVICE" strategy=ddp
    check "DDP on 2 shared ranks ends at the 1-rank run" pycheck close "$s/ddp" "$s/one" 1e-5 1e-6 \
      && add_note "DDP $(cut -d'(' -f1 <<< "$LAST")"
  fi
  DDPKIT_SHARE_GPU=1 trained share-fsdp "$s/fsdp" "${g[@]}" --nproc 2 --strategy fsdp --epochs 10 --save-every 10 \
    || return 0
  check "FSDP2, 2 ranks on $EXPECT_DEVICE over gloo" pycheck summary "$s/fsdp" world_size=2 backend=gloo \
    device="$EXPECT_DEVICE" strategy=fsdp
  [[ $MODE == gpu ]] && check "rank 0 says the ranks share the GPU" grep_out share-fsdp "2 ranks share 1 GPU(s) over gloo"
  check "sharded checkpoint: a shard per rank, every rank's RNG state (CUDA's on a GPU)" "$PYTHON" -c '
import sys, torch
from pathlib import Path
d, mode = Path(sys.argv[1]), sys.argv[2]
assert {"__0_0.distcp", "__1_0.distcp"} <= {p.name for p in d.iterdir()}, sorted(p.name for p in d.iterdir())
rng = torch.load(d / "ddpkit.pt", weights_only=True)["rng"]
assert len(rng) == 2, len(rng)
if mode == "gpu":
    assert all("cuda" in r and r["cuda"].numel() > 0 for r in rng), [sorted(r) for r in rng]
print(f"2 shards, RNG keys {sorted(rng[0])}")' "$s/fsdp/checkpoints/epoch-000010" "$MODE"
  if trained share-resume "$s/fsdp" "${one[@]}" --resume; then
    check "resumed at world 1 from the 2-rank sharded checkpoint" grep_out share-resume "resuming from .*epoch-000010"
    check "FSDP 10 epochs on 2 shared ranks + 10 resumed on 1 ends at the 1-rank run" \
      pycheck close "$s/fsdp" "$s/one" 1e-5 1e-6 && add_note "FSDP+resume $(cut -d'(' -f1 <<< "$LAST")"
  fi
  add_note "gloo on $EXPECT_DEVICE; NCCL, P2P and multi-GPU bandwidth not exercised"
}

step_gpt() {
  local left rc t0=$SECONDS json=$WORK/gpt.json md=$WORK/gpt_mfu.md args=()
  # what fits the time left (GPU: ~20 s a row to start and run, ~60 s more a compiled row)
  left=$(( HARD_S - (SECONDS - START) - 15 ))
  if [[ $MODE == cpu ]]; then args=(--variants fast --no-compile)  # the wiring, not a measurement
  elif (( left >= 170 )); then args=(--variants default,fast)
  elif (( left >= 110 )); then args=(--variants fast)
  elif (( left >= 45 )); then args=(--variants fast --no-compile); add_note "compile rows left uncompiled: ${left} s left"
  else add_note "not run: ${left} s left"; STEP_OK=0; return 0
  fi
  args+=("${GPT_SHAPE[@]}" --batch-size "$GPT_BATCH" --steps "$GPT_STEPS" "${GPT_PEAK[@]}" --timeout "$(limit "$left")")
  note "\$ $PYTHON benchmarks/gpt_mfu.py --device $DEV ${args[*]} --out $md --json $json"
  tmo "$(limit "$left")" "$PYTHON" benchmarks/gpt_mfu.py --device "$DEV" "${args[@]}" --out "$md" --json "$json" \
    > "$WORK/out/gpt.txt" 2>&1
  rc=$?
  cat "$WORK/out/gpt.txt" >> "$LOG"
  for f in "$WORK"/logs-gpt-mfu/*; do [[ -f $f ]] && { note "--- $(basename "$f")"; cat "$f" >> "$LOG"; }; done
  note "(exit $rc after $((SECONDS - t0)) s)"
  sed -n '/^| variant/,/^$/p' "$WORK/out/gpt.txt"
  check "benchmarks/gpt_mfu.py exits 0" test "$rc" -eq 0 || tail -n 15 "$WORK/out/gpt.txt" | sed 's/^/      | /'
  [[ -f $json ]] || return 0
  check "every GPT row measured, ddpkit's with its MFU" pycheck gpt "$json" && add_note "$LAST"
  STEP_MFU=$(pycheck gpt_mfu "$json" 2>/dev/null | cut -d' ' -f1)
  if [[ -s $md && -f $OUTDIR/gpu.md ]]; then printf '\n' >> "$OUTDIR/gpu.md"; cat "$md" >> "$OUTDIR/gpu.md"
  elif [[ -s $md ]]; then cp "$md" "$OUTDIR/gpu.md"; fi
  [[ $MODE == cpu ]] && add_note "CPU: MFU against a nominal ${GPT_PEAK[1]} TFLOP/s"
  return 0
}

# ---------------------------------------------------------------- run
say "gpu_check ($MODE) $(date '+%F %T') on $(uname -n 2>/dev/null || echo '?'): repo $REPO"
say "  python $PYTHON ($("$PYTHON" -c 'import sys; print(sys.version.split()[0])')), torch $TORCH_VERSION, CUDA build $TORCH_CUDA, GPUs visible $NGPU"
say "  output $OUTDIR, work $WORK, budget ${BUDGET_S} s"
note "  git: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'no git') $(git -C "$REPO" status --short 2>/dev/null | wc -l) changed files"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>&1 | sed 's/^/  nvidia-smi: /' | tee -a "$LOG"
note "  env: CUBLAS_WORKSPACE_CONFIG=$CUBLAS_WORKSPACE_CONFIG NCCL_DEBUG=$NCCL_DEBUG NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-} CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-}"
note "  packages: $("$PYTHON" -c '
import importlib.metadata as m
out = []
for p in ("numpy", "scikit-learn", "triton", "tqdm"):
    try: out.append(f"{p} {m.version(p)}")
    except m.PackageNotFoundError: out.append(f"{p} -")
print(", ".join(out))' 2>&1)"

step 1 env step_env
step 2 train step_train
step 3 bf16 step_bf16
step 4 fsdp step_fsdp
step 5 fused step_fused
step 6 compile step_compile
step 7 resume step_resume
step 7b resume-cnn step_resume_cnn
step 8 bench step_bench
step 9 fp16 step_fp16
step 10 syncdebug step_syncdebug
step 11 sharegpu step_sharegpu
step 8b gpt step_gpt  # last: the measurement that adapts to the time left

pycheck collect "$OUTDIR/summaries.json" "$W"/* > /dev/null 2>&1
FAILED=0
{
  printf '\n%-4s %-11s %-6s %5s %8s  %s\n' step name status secs mfu note
  for row in "${ROWS[@]}"; do
    IFS=$SEP read -r id name status secs mfu text <<< "$row"
    [[ $status == PASS ]] || FAILED=1
    printf '%-4s %-11s %-6s %5s %8s  %s\n' "$id" "$name" "$status" "$secs" "$mfu" "$text"
  done
} > "$WORK/table.txt"
grep -q ' FAIL ' "$WORK/table.txt" && FAILED=1
{
  echo "gpu_check ($MODE): torch $TORCH_VERSION on $([[ $MODE == gpu ]] && echo "$NGPU GPU(s)" || echo CPU), $((SECONDS - START)) s"
  cat "$WORK/table.txt"
} > "$OUTDIR/gpu_check_table.txt"
say ""
cat "$OUTDIR/gpu_check_table.txt" | tee -a "$LOG"
if [[ $FAILED -eq 0 ]]; then
  say "gpu_check: every step passed ($((SECONDS - START)) s); log: $LOG"
  rm -rf "$WORK"
  exit 0
fi
say "gpu_check: some step FAILED (see above and $LOG); run directories kept in $WORK"
exit 1
