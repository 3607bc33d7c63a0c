"""`ddpkit verify`: is a task exact at any world size? ddpkit's sharding, weighting and
evaluation make the same model at 1 or N processes, but a task can break it (a loss averaged
per micro-batch over padded tokens, a forward that depends on the rank, a metric that is not
a sum), and only a comparison step by step shows where.

It runs real trainings, through the launcher and workers `ddpkit train` uses, for a few
optimizer steps at one global batch G: 1 x G (the reference), N x G/N (the user's setup,
with its --accumulate), 1 x G/2 accumulating 2; the N-process run also checkpoints part way
and a copy of it resumes from there (the round trip). Every run writes its parameters after
each step (training/trace.py); this compares them step by step against the reference (the
round trip against the run it copied) and the final evaluation's loss and metric.

Rounding must neither hide nor fake a drift: runs are in float64 where the task allows it
(the model and its floating inputs cast), where rounding over a few steps stays far below
the tolerance; a task that fails in float64 runs in float32 and only its first steps are
judged, since Adam turns a float32 rounding difference into one of the order of the
learning rate. The report says which was done.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import DdpkitError

TOLERANCE = {True: 1e-9, False: 1e-5}  # float64 / float32: far above rounding over a few steps
JUDGED_STEPS_FLOAT32 = 2
EVAL_RTOL = 1e-7  # the final evaluation's loss and metric (float64 runs only)

CAUSES = (
    "usual causes: a loss averaged per micro-batch (a mean over padded tokens, a mean of means) instead of "
    "summed over the global count: return (loss_sum, count) from Task.step; a forward that depends on the "
    "rank or world size (BatchNorm's per-rank batch statistics); randomness not drawn from the generators "
    "ddpkit seeds (dropout draws per rank: verify with it off); a checkpoint that misses state (the round trip)"
)


@dataclass(frozen=True)
class Setup:
    nproc: int
    batch_size: int
    accumulate: int = 1

    @property
    def label(self) -> str:
        return f"{self.nproc} x {self.batch_size}" + (f" accumulate {self.accumulate}" if self.accumulate > 1 else "")


@dataclass
class Comparison:
    """One run against its reference: the largest drift of every parameter over the steps
    compared, and the first step (and parameter) where a drift passed the tolerance."""

    label: str
    against: str
    steps: range
    drift: dict[str, float] = field(default_factory=dict)
    first: tuple[int, str, float] | None = None


def plan_setups(nproc: int, batch_size: int, accumulate: int) -> list[Setup]:
    """The setups with the user's global batch G = nproc x batch x accumulate: 1 x G first (the
    reference), the user's own, 1 x G/2 accumulating 2 when G is even."""
    g = nproc * batch_size * accumulate
    setups = [Setup(1, g), Setup(nproc, batch_size, accumulate)]
    if g % 2 == 0:
        setups.append(Setup(1, g // 2, 2))
    return list(dict.fromkeys(setups))


def verify(config: Any = None, *, steps: int = 6, _clean_parent: bool = False, **overrides: Any) -> dict[str, Any]:
    """Run the task at several world sizes for `steps` optimizer steps and compare; returns the
    report (`exact`, `float64`, the comparisons, the text printed). The runs go to a temporary
    folder, or to --run-dir (kept) when it is given."""
    from ..config import RunConfig
    from ..environments import DistEnv
    from ..launchers.plan import resolve_nproc
    from ..runtime import resolve_device_type

    cfg = (config or RunConfig()).replace(**overrides) if overrides else (config or RunConfig())
    if DistEnv.detect().outside_launcher:
        raise DdpkitError("ddpkit verify starts its own processes: run it outside torchrun / srun / mpirun")
    nproc = resolve_nproc(cfg.nproc, resolve_device_type(cfg.device))
    if nproc < 2:
        raise DdpkitError(f"ddpkit verify compares 1 process with --nproc N: --nproc {nproc} compares nothing (use 2+)")
    if steps < 3:
        raise DdpkitError(
            f"--steps {steps}: verify needs at least 3 optimizer steps (the round trip resumes after more than half)"
        )
    from ..task import check_task_call, load_task_function

    check_task_call(cfg.task, load_task_function(cfg.task), cfg.task_args)  # not found: one line, before any run
    root = Path(cfg.run_dir) if cfg.run_dir else Path(tempfile.mkdtemp(prefix="ddpkit-verify-"))
    if cfg.run_dir and root.exists() and any(root.iterdir()):
        raise DdpkitError(f"--run-dir {root} is not empty: verify writes its runs there; choose a new folder")
    try:
        return _verify(cfg, nproc, steps, root, _clean_parent)
    finally:
        if not cfg.run_dir:
            shutil.rmtree(root, ignore_errors=True)


def _verify(cfg: Any, nproc: int, steps: int, root: Path, clean_parent: bool) -> dict[str, Any]:
    setups = plan_setups(nproc, cfg.batch_size, cfg.accumulate)
    ref, user, others = setups[0], setups[1], setups[2:]
    resume_at = steps // 2 + 1  # the only checkpoint of the user's run: 2 x resume_at > steps
    dirs = {s: root / s.label.replace(" ", "") for s in setups}
    # every run in a process of its own (this one runs no torch op until the comparison, so
    # workers may be forked from it); the reference first, silent, to learn whether float64 works
    float64 = True
    try:
        summaries = {ref: _run(cfg, ref, dirs[ref], steps, True, clean_parent, silent=True)}
    except DdpkitError as e:
        print(f"ddpkit verify: the task fails in float64 ({e}); comparing in float32", flush=True)
        float64 = False
        shutil.rmtree(dirs[ref], ignore_errors=True)
        summaries = {ref: _run(cfg, ref, dirs[ref], steps, False, clean_parent)}
    summaries[user] = _run(cfg, user, dirs[user], steps, float64, clean_parent, save_every_steps=resume_at)
    for s in others:
        summaries[s] = _run(cfg, s, dirs[s], steps, float64, clean_parent)
    round_trip = root / "resumed"
    _copy_until(dirs[user], round_trip)
    _run(cfg, user, round_trip, steps, float64, clean_parent, resume=True)
    judged = range(1, steps + 1) if float64 else range(1, min(steps, JUDGED_STEPS_FLOAT32) + 1)
    tol = TOLERANCE[float64]
    comparisons = [
        compare(dirs[ref], dirs[s], range(1, steps + 1), judged, tol, s.label, ref.label) for s in setups[1:]
    ]
    comparisons.append(
        compare(
            dirs[user],
            round_trip,
            range(resume_at + 1, steps + 1),
            range(resume_at + 1, steps + 1),  # the same world size and arithmetic: every step is judged
            tol,
            f"resumed at step {resume_at}",
            f"{user.label} uninterrupted",
        )
    )
    # in float32 the later steps' rounding may have grown: the final evaluations are not comparable
    evals = eval_differences(summaries, ref, EVAL_RTOL) if float64 else []
    text = format_report(cfg.task, steps, nproc * cfg.batch_size * cfg.accumulate, float64, judged, tol, comparisons)
    exact = all(c.first is None for c in comparisons) and not evals
    text += "\n" + verdict(comparisons, evals, exact)
    return {"exact": exact, "float64": float64, "comparisons": comparisons, "eval_differences": evals, "text": text}


def _run(
    cfg: Any, setup: Setup, run_dir: Path, steps: int, float64: bool, clean: bool, silent: bool = False, **more: Any
) -> dict[str, Any]:
    """One real training run of `steps` optimizer steps that writes its trace; its summary."""
    one = setup.nproc == 1
    settings = dict(
        nproc=setup.nproc,
        batch_size=setup.batch_size,
        accumulate=setup.accumulate,
        strategy="ddp" if one else cfg.strategy,  # (FSDP needs 2; on one process both are the plain model)
        run_dir=str(run_dir),
        max_steps=steps,
        threads=1,  # the same arithmetic in every process, whatever the world size
        quiet=True,
        trace_steps=True,
        float64=float64,
        save_every=0,
        save_every_steps=None,
        save_every_minutes=None,
        keep_last=None,
        keep_best=None,
        eval_every_steps=None,
        max_restarts=0,
        resume=False,
        auto_resume=False,
    )
    return in_child(cfg.replace(**(settings | more)).as_dict(), clean, silent)


def in_child(config: dict[str, Any], clean: bool, silent: bool) -> dict[str, Any]:
    """`ddpkit.train(config)` in a child process (forked when this one is clean, else spawned):
    one process's run leaves no torch state here. Its output goes nowhere but its errors (a
    silent one, the float64 probe, prints nothing at all); a failure comes back as a
    DdpkitError with the error's last line."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork" if clean else "spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(config, send, clean, silent), daemon=False)
    child.start()
    send.close()
    try:
        kind, value = receive.recv()
    except EOFError:
        kind, value = "error", f"the run's process died (exit code {child.join() or child.exitcode})"
    child.join()
    if kind == "error":
        raise DdpkitError(value)
    return value


def _child(config: dict[str, Any], send: Any, clean: bool, silent: bool) -> None:
    import os
    import traceback

    from ..api import train
    from ..config import RunConfig

    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # what the task prints (its on_metrics, say) would repeat once per run
    if silent:
        os.dup2(null, 2)
    try:
        send.send(("ok", train(RunConfig.from_dict(config), _clean_parent=clean)))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent as one line
        if not silent and not isinstance(e, DdpkitError):
            traceback.print_exc()
        last = str(e).strip().splitlines()[-1:] or [""]
        send.send(("error", f"{type(e).__name__}: {last[0]}" if not isinstance(e, DdpkitError) else str(e)))


def _copy_until(src: Path, dst: Path) -> None:
    """The run and its one checkpoint, without what came after it (its trace, its model.pt)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("trace", "model.pt", "hang"))


def load_step(run_dir: Path, step: int) -> dict[str, Any]:
    import torch

    from ..training.trace import trace_file

    path = trace_file(run_dir, step)
    if not path.is_file():
        raise DdpkitError(f"{run_dir.name} wrote no parameters for step {step}: did the run stop early?")
    return torch.load(path, weights_only=True)


def compare(ref: Path, other: Path, steps: range, judged: range, tol: float, label: str, against: str) -> Comparison:
    """The largest drift per parameter (float64 differences) over `steps`; a drift over `tol`
    counts only in the `judged` steps."""
    out = Comparison(label, against, steps)
    for step in steps:
        a, b = load_step(ref, step), load_step(other, step)
        worst: tuple[float, str] | None = None
        for name, value in a.items():
            if not value.is_floating_point():
                continue
            d = (value.double() - b[name].double()).abs().max().item() if value.numel() else 0.0
            d = d if math.isfinite(d) else math.inf
            out.drift[name] = max(out.drift.get(name, 0.0), d)
            if worst is None or d > worst[0]:
                worst = (d, name)
        if out.first is None and worst is not None and worst[0] > tol and step in judged:
            out.first = (step, worst[1], worst[0])
    return out


def eval_differences(summaries: dict[Setup, dict[str, Any]], ref: Setup, rtol: float) -> list[str]:
    """The final evaluation's figures that differ from the reference's more than rounding."""
    out = []
    base = summaries[ref]
    for setup, summary in summaries.items():
        for key in sorted(k for k in base if k.startswith("eval_")):
            x, y = base[key], summary.get(key)
            if isinstance(x, (int, float)) and isinstance(y, (int, float)) and abs(x - y) > rtol * max(1.0, abs(x)):
                out.append(f"{key} {y:.6g} at {setup.label}, {x:.6g} at {ref.label}")
    return out


def format_report(
    task: str, steps: int, g: int, float64: bool, judged: range, tol: float, comparisons: list[Comparison]
) -> str:
    how = (
        "in float64 (the model and its floating inputs cast)"
        if float64
        else f"in float32 (the task fails in float64): only steps 1-{judged.stop - 1} are judged, as Adam lets "
        "float32 rounding grow"
    )
    lines = [
        f"ddpkit verify: {task}, {steps} optimizer steps at global batch {g}, {how}; tolerance {tol:.0e}",
    ]
    for c in comparisons:
        where = f"first over at step {c.first[0]} ({c.first[1]})" if c.first else "within tolerance"
        lines.append(f"  {c.label} vs {c.against} (steps {c.steps.start}-{c.steps.stop - 1}): {where}")
    names = list(comparisons[0].drift)
    width = max(len("parameter"), *(len(n) for n in names))
    heads = [c.label if len(c.label) <= 22 else c.label[:21] + "." for c in comparisons]
    col = max(12, *(len(h) for h in heads))
    lines.append("  largest drift per parameter:")
    lines.append("    " + "parameter".ljust(width) + "".join("  " + h.rjust(col) for h in heads))
    for n in names:
        lines.append("    " + n.ljust(width) + "".join(f"  {c.drift.get(n, 0.0):>{col}.2e}" for c in comparisons))
    return "\n".join(lines)


def verdict(comparisons: list[Comparison], evals: list[str], exact: bool) -> str:
    if exact:
        return "ddpkit verify: exact: the same parameters at every step, world size, accumulation and after a resume"
    drifting = [c for c in comparisons if c.first is not None]
    if drifting:
        c = min(drifting, key=lambda c: c.first[0])
        step, name, value = c.first
        return (
            f"ddpkit verify: NOT exact: {name} drifts by {value:.2e} at step {step} ({c.label} vs {c.against}); "
            + CAUSES
        )
    return (
        "ddpkit verify: NOT exact: the parameters agree but the final evaluation differs ("
        + "; ".join(evals)
        + "): a metric must return the batch's SUM (e.g. the number correct), ddpkit divides by the count"
    )
