"""`ddpkit verify`: is a task exact at any world size? ddpkit's sharding, weighting and
evaluation make the same model at 1 or N processes, but a task can break it (a loss averaged
per micro-batch over padded tokens, a forward that depends on the rank, a metric that is not
a sum), and only a comparison step by step shows where.

It runs real trainings, through the launcher and workers `ddpkit train` uses, for a few
optimizer steps at one global batch G: 1 x G (the reference), N x G/N (the user's setup,
with its --accumulate), 1 x G/2 accumulating 2; the N-process run also checkpoints part way
and a copy of it resumes from there (the round trip). Every run writes its parameters after
each step (training/trace.py); this compares them step by step against the reference (the
round trip against the run it copied) and the final evaluation's loss and metric. The model's
nn.Dropout is off in every run (each process draws its own masks: with it on no two world
sizes agree), and the report names what was turned off; every run is --deterministic (the
same kernels each time, so a difference is the world size's, not a kernel's choice). When cutting the batch otherwise
drifts, one more 1 x G run with other random draws tells randomness from the task's
arithmetic; tools/verify_report.py names the cause the evidence points to.

Rounding must neither hide nor fake a drift: runs are in float64 where the task allows it
(the model and its floating inputs cast), where rounding over a few steps stays far below
the tolerance; a task that fails in float64 runs in float32 and only its first steps are
judged, since Adam turns a float32 rounding difference into one of the order of the
learning rate. The report says which was done.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..errors import DdpkitError
from .verify_report import (  # noqa: F401  (compare, eval_differences, Setup: verify's parts, tested as such)
    EXACT,
    Comparison,
    Evidence,
    Setup,
    compare,
    diagnose,
    eval_differences,
    format_report,
)

TOLERANCE = {True: 1e-9, False: 1e-5}  # float64 / float32: far above rounding over a few steps
JUDGED_STEPS_FLOAT32 = 2
EVAL_RTOL = 1e-7  # the final evaluation's loss and metric (float64 runs only)


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
    if cfg.batch_size == "auto":
        raise DdpkitError("ddpkit verify compares runs at one fixed batch: give --batch-size, not auto")
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
    round_trip_dir = root / "resumed"
    _copy_until(dirs[user], round_trip_dir)
    _run(cfg, user, round_trip_dir, steps, float64, clean_parent, resume=True)
    judged = range(1, steps + 1) if float64 else range(1, min(steps, JUDGED_STEPS_FLOAT32) + 1)
    tol = TOLERANCE[float64]
    ranks, *accumulation = [
        compare(dirs[ref], dirs[s], range(1, steps + 1), judged, tol, s.label, ref.label) for s in setups[1:]
    ]
    round_trip = compare(
        dirs[user],
        round_trip_dir,
        range(resume_at + 1, steps + 1),
        range(resume_at + 1, steps + 1),  # the same world size and arithmetic: every step is judged
        tol,
        f"resumed at step {resume_at}",
        f"{user.label} uninterrupted",
    )
    # in float32 the later steps' rounding may have grown: the final evaluations are not comparable
    evidence = Evidence(
        ranks,
        accumulation[0] if accumulation else None,
        round_trip,
        eval_differences(summaries, ref, EVAL_RTOL) if float64 else [],
        _turned_off(dirs[ref]),
    )
    if evidence.batch_drifts and not evidence.batchnorm_first:  # would other random draws alone change 1 x G?
        probe = root / "other-draws"
        _run(cfg, ref, probe, steps, float64, clean_parent, draws_seed=cfg.seed + 7919)
        evidence.draws_matter = compare(dirs[ref], probe, judged, judged, tol, "", "").first is not None
    g = nproc * cfg.batch_size * cfg.accumulate
    return _report(cfg.task, steps, g, float64, judged, tol, evidence, summaries)


def _report(
    task: str, steps: int, g: int, float64: bool, judged: range, tol: float, evidence: Evidence, summaries: dict
) -> dict[str, Any]:
    """The report: the comparisons' table, the verdict, the evidence behind it."""
    comparisons = evidence.comparisons
    deterministic = all(s.get("deterministic") for s in summaries.values())  # as every run recorded it
    line, code = diagnose(evidence)
    return {
        "exact": code == EXACT,
        "exit_code": code,
        "float64": float64,
        "comparisons": comparisons,
        "eval_differences": evidence.evals,
        "dropout_off": evidence.dropout_off,
        "deterministic": deterministic,
        "text": format_report(task, steps, g, float64, judged, tol, comparisons, deterministic) + "\n" + line,
    }


def _turned_off(run_dir: Path) -> list[str]:
    """The dropout modules a run turned off (its trace says), by name."""
    import json

    from ..training.trace import DROPOUT_FILE, TRACE_DIR

    path = run_dir / TRACE_DIR / DROPOUT_FILE
    return json.loads(path.read_text()) if path.is_file() else []


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
        dropout_off=True,  # its masks are drawn per process: with it on no two world sizes agree
        deterministic=True,  # the same kernels every run: a difference is the world size's, not a kernel's choice
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

    from ..config import RunConfig
    from ..run.train import train

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
