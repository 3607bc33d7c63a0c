"""What `ddpkit verify` reads from its runs and says about them: the drift of every parameter
step by step (compare), the final evaluations, the table, and the verdict, which names the
cause the evidence points to (tools/verify.py runs the trainings that give the evidence):

- only the resumed copy drifts: state the checkpoint does not hold;
- a BatchNorm buffer (running_mean / running_var) is among the first tensors to drift:
  BatchNorm normalizes by its batch's statistics, which depend on how the batch is cut;
- 1 x G with other random draws (the per-rank streams, seeded otherwise) differs from 1 x G:
  the training draws random numbers beyond nn.Dropout (which verify turns off itself);
- accumulation exact, N processes not: something computed per rank and not reduced;
- accumulation drifts too: a loss averaged per micro-batch instead of summed over the count;
- the parameters agree, the final evaluation does not: a metric that is not a sum.

Exit codes: 0 exact (also when only the model's nn.Dropout was turned off: its masks are
drawn per rank by design, not a bug); 1 a drift the task can fix; 3 randomness verify cannot
turn off (the rest cannot be judged until it is off)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import DdpkitError

EXACT, DRIFTS, RANDOM = 0, 1, 3  # the exit codes of the outcomes
BN_BUFFERS = ("running_mean", "running_var")


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
    compared, the first step (and tensor) where a drift passed the tolerance, and every
    tensor over the tolerance at that step."""

    label: str
    against: str
    steps: range
    drift: dict[str, float] = field(default_factory=dict)
    first: tuple[int, str, float] | None = None
    first_over: list[str] = field(default_factory=list)


@dataclass
class Evidence:
    """What the runs showed: N processes against 1 x G, 1 x G/2 accumulating 2 against it (None
    for an odd G), the resumed copy against the run it copied, the final evaluations that
    differ, the dropout modules turned off, and whether other random draws change 1 x G (None:
    not asked, as nothing drifted or BatchNorm already explains it)."""

    ranks: Comparison
    accumulation: Comparison | None
    round_trip: Comparison
    evals: list[str] = field(default_factory=list)
    dropout_off: list[str] = field(default_factory=list)
    draws_matter: bool | None = None

    @property
    def comparisons(self) -> list[Comparison]:
        return [c for c in (self.ranks, self.accumulation, self.round_trip) if c is not None]

    @property
    def batchnorm_first(self) -> str | None:
        """The first BatchNorm buffer among the first tensors to drift, where one is."""
        for c in sorted((c for c in (self.ranks, self.accumulation) if c and c.first), key=lambda c: c.first[0]):
            return next((n for n in c.first_over if n.rsplit(".", 1)[-1] in BN_BUFFERS), None)
        return None

    @property
    def batch_drifts(self) -> bool:
        """Does cutting the batch otherwise (processes, accumulation) change the parameters?"""
        return any(c is not None and c.first is not None for c in (self.ranks, self.accumulation))


def load_step(run_dir: Path, step: int) -> dict[str, Any]:
    from ..checkpoint.file import load_file
    from ..training.trace import trace_file

    path = trace_file(run_dir, step)
    if not path.is_file():
        raise DdpkitError(f"{run_dir.name} wrote no parameters for step {step}: did the run stop early?")
    return load_file(path)  # plain data, refused in one line if crafted


def compare(ref: Path, other: Path, steps: range, judged: range, tol: float, label: str, against: str) -> Comparison:
    """The largest drift per parameter (float64 differences) over `steps`; a drift over `tol`
    counts only in the `judged` steps."""
    out = Comparison(label, against, steps)
    for step in steps:
        a, b = load_step(ref, step), load_step(other, step)
        worst: tuple[float, str] | None = None
        over = []
        for name, value in a.items():
            if not value.is_floating_point():
                continue
            d = (value.double() - b[name].double()).abs().max().item() if value.numel() else 0.0
            d = d if math.isfinite(d) else math.inf
            out.drift[name] = max(out.drift.get(name, 0.0), d)
            if d > tol:
                over.append(name)
            if worst is None or d > worst[0]:
                worst = (d, name)
        if out.first is None and worst is not None and worst[0] > tol and step in judged:
            out.first, out.first_over = (step, worst[1], worst[0]), over
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
    task: str,
    steps: int,
    g: int,
    float64: bool,
    judged: range,
    tol: float,
    comparisons: list[Comparison],
    deterministic: bool = False,
) -> str:
    how = (
        "in float64 (the model and its floating inputs cast)"
        if float64
        else f"in float32 (the task fails in float64): only steps 1-{judged.stop - 1} are judged, as Adam lets "
        "float32 rounding grow"
    )
    lines = [
        f"ddpkit verify: {task}, {steps} optimizer steps at global batch {g}, {how}"
        + (", deterministic kernels" if deterministic else "")  # --deterministic, as every run recorded it
        + f"; tolerance {tol:.0e}",
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


def diagnose(ev: Evidence) -> tuple[str, int]:
    """The verdict line and the exit code: the cause the evidence points to."""
    dropout = _dropout_note(ev.dropout_off)
    if not ev.batch_drifts and ev.round_trip.first is None:
        if ev.evals:
            return (
                "ddpkit verify: NOT exact: the parameters agree but the final evaluation differs ("
                + "; ".join(ev.evals)
                + "): a metric must return the batch's SUM (e.g. the number correct), ddpkit divides by the count",
                DRIFTS,
            )
        line = "ddpkit verify: exact: the same parameters at every step, world size, accumulation and after a resume"
        return line + (f" ({dropout})" if dropout else ""), EXACT
    if not ev.batch_drifts:
        step, name, value = ev.round_trip.first
        return (
            f"ddpkit verify: NOT exact: only the resumed run drifts ({name} by {value:.2e} at step {step}, "
            "every world size and accumulation agree): the checkpoint misses state that changes while training "
            "(a scheduler, a counter, an EMA or a data position of the task's own): keep it in the model's or "
            "optimizer's state_dict, or give the checkpointer an object with state() / load(state)",
            DRIFTS,
        )
    c = min((c for c in ev.comparisons[:-1] if c.first is not None), key=lambda c: c.first[0])
    step, name, value = c.first
    where = f"{name} drifts by {value:.2e} at step {step} ({c.label} vs {c.against})"
    also = "; the resumed run drifts too" if ev.round_trip.first is not None else ""
    buffer = ev.batchnorm_first
    if buffer:
        return (
            f"ddpkit verify: NOT exact: BatchNorm's running statistics drift first ({buffer} at step {step}, "
            f"{c.label} vs {c.against}): BatchNorm normalizes by the statistics of the batch it sees, which depend "
            "on how the global batch is cut (per process, per micro-batch); torch.nn.SyncBatchNorm."
            "convert_sync_batchnorm(model) shares them across processes, LayerNorm or GroupNorm do not depend on "
            "the batch" + also + (f" ({dropout})" if dropout else ""),
            DRIFTS,
        )
    if ev.draws_matter:
        return (
            f"ddpkit verify: cannot judge: {where}, and 1 x G with other random draws differs from 1 x G: the "
            "training draws random numbers (F.dropout, torch.rand in a forward, random augmentation"
            + (", beside the nn.Dropout verify turned off" if ev.dropout_off else "")
            + "); each process draws its own, so no two world sizes can agree. Turn it off (a task argument, "
            "e.g. --task-arg augment=False) and run verify again to judge the rest",
            RANDOM,
        )
    line = f"ddpkit verify: NOT exact: {where}: {_batch_cause(ev)}" + also
    return line + (f" ({dropout})" if dropout else ""), DRIFTS


def _batch_cause(ev: Evidence) -> str:
    """Why cutting the batch otherwise drifts, when neither BatchNorm nor randomness explain it."""
    if ev.accumulation is not None and ev.accumulation.first is None:
        return (
            f"accumulating 2 micro-batches is exact but {ev.ranks.label} is not: something is computed per process "
            "and not reduced across processes (a loss divided by the world size or by the process's own count, a "
            "forward or data that reads the rank)"
        )
    if ev.accumulation is not None:
        return (
            "a loss averaged per micro-batch (a mean over padded tokens, a mean of means) instead of summed over "
            "the global count: return (loss_sum, count) from Task.step"
        )
    return (  # an odd global batch: no accumulation to tell the two apart
        "a loss averaged per micro-batch instead of summed over the global count (return (loss_sum, count) "
        "from Task.step), or something computed per process and not reduced across processes"
    )


def _dropout_note(names: list[str]) -> str:
    if not names:
        return ""
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (
        f"with the model's dropout off: {shown}; dropout draws its masks per process, so with it on no two "
        "world sizes agree: expected of dropout, not a bug"
    )
