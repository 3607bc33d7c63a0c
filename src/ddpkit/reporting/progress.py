"""What rank 0 shows while a run trains: a tqdm bar on a terminal, plain lines in a log file.

Modes (``--progress``): ``bar`` draws two tqdm bars on stdout, one over the epochs (with
the run's ETA) and one over the samples of the current epoch (samples/s, the epoch's ETA),
and writes each epoch's line above them. ``lines`` prints that epoch line only, plus a
line every 30 s inside long epochs, so a SLURM log shows a slow run moving. ``auto``
(the default) is ``bar`` when stdout is a terminal and tqdm is installed, else ``lines``.
``--quiet`` and every rank but 0 show nothing.

Which loss is shown where. The exact global mean of an epoch's loss is computed once per
epoch, at its end (the trainer's one all-reduce, which metrics.jsonl needs anyway); the
epoch lines and the epoch bar show that value as ``train_loss``/``loss``. Inside an epoch
the step bar shows ``rank0_loss``: rank 0's own running mean over its shard so far. A
cross-rank value at every step would cost an all-reduce per step, just for the display.
On the step path this module does no tensor work unless a display is due (at most every
0.5 s on a bar, every 30 s in lines), so it adds no device sync to training.
"""

from __future__ import annotations

import os
import sys
import time
from importlib.util import find_spec
from typing import Any, TextIO

import torch

from ..util.envvars import PROGRESS_INTERVAL_VAR
from .throughput import Throughput

LINE_INTERVAL_S = 30.0
BAR_REFRESH_S = 0.5


def choose_mode(requested: str, quiet: bool, is_main: bool, stream: TextIO) -> str:
    """'off', 'bar' or 'lines'. A bar needs tqdm; without it (or off a terminal) lines."""
    if quiet or not is_main:
        return "off"
    has_tqdm = find_spec("tqdm") is not None
    if requested == "bar":
        return "bar" if has_tqdm else "lines"
    if requested == "lines":
        return "lines"
    return "bar" if has_tqdm and _isatty(stream) else "lines"


def epoch_line(record: dict[str, Any], epochs: int | None, max_steps: int | None = None) -> str:
    """`epoch N/E  train_loss X  eval_loss Y  eval_accuracy Z` (the format tests and logs parse);
    a run by --max-steps also shows `step S/M` after the epoch: the steps are what ends it."""
    width = len(str(epochs))
    of = f"/{epochs}" if epochs else ""  # None: a stream run by --max-steps (no number of passes)
    parts = [f"epoch {record['epoch']:>{width if epochs else 1}}{of}"]
    if max_steps and "step" in record:
        parts.append(f"step {record['step']:>{len(str(max_steps))}}/{max_steps}")
    parts.append(f"train_loss {record['train_loss']:.4f}")
    parts += [f"{k} {v:.4f}" for k, v in record.items() if k.startswith("eval_")]
    return "  ".join(parts)


def rates_text(rates: dict[str, Any]) -> str:
    """What follows samples/s on a progress line: `  tokens/s N` for tokens, `  TFLOP/s X  mfu Y%`
    where the device's peak is known (on a CPU without --peak-tflops, no TFLOP/s: summary.json
    and metrics.jsonl have them)."""
    text = f"  tokens/s {rates['tokens_per_s']:,.0f}" if rates.get("tokens_per_s") else ""
    if rates.get("mfu") is not None:
        text += f"  TFLOP/s {rates['tflops_per_device']:.3g}  mfu {rates['mfu']:.1%}"
    return text


def format_eta(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Called by the trainer at epoch and step boundaries; shows nothing in mode 'off'."""

    def __init__(
        self,
        mode: str,
        epochs: int | None,
        start_epoch: int,
        samples_per_epoch: int | None,
        stream: TextIO | None = None,
        max_steps: int | None = None,
        throughput: Throughput | None = None,
    ) -> None:
        self.mode = mode
        self.throughput = throughput  # tokens/s, TFLOP/s and MFU beside samples/s
        self.epochs = epochs
        self.max_steps = max_steps  # a run by --max-steps: the epoch lines show the steps too
        self.samples_per_epoch = samples_per_epoch
        self.stream = stream or sys.stdout
        self.line_interval = float(os.environ.get(PROGRESS_INTERVAL_VAR, LINE_INTERVAL_S))
        self._epochs_done_here = 0
        self._first_start: float | None = None  # wall time of this session's epochs: eval and checkpoints count
        self._last_end = 0.0
        self._epoch = start_epoch
        self._epoch_bar: Any = None
        self._step_bar: Any = None
        if mode == "bar":
            from tqdm import tqdm

            self._tqdm = tqdm
            self._epoch_bar = tqdm(
                total=epochs,
                initial=start_epoch,
                desc="epochs",
                unit="epoch",
                file=self.stream,
                position=0,
                dynamic_ncols=True,
                leave=True,
            )

    def start_epoch(
        self, epoch: int, skipped_samples: int = 0, loss_offset: float = 0.0, count_offset: float = 0.0
    ) -> None:
        """`skipped_samples`: done before a mid-epoch stop this run resumes from; `loss_offset`,
        `count_offset`: what the trainer's sums already hold for them (not rank 0's own)."""
        if self.mode == "off":
            return
        self._epoch = epoch
        self._seen_local = 0
        self._seen_global = skipped_samples
        self._skipped = skipped_samples
        self._loss_offset = loss_offset
        self._count_offset = count_offset
        self._t0 = self._last_shown = time.perf_counter()
        if self._first_start is None:
            self._first_start = self._t0
        if self.mode == "bar":
            self._last_shown -= BAR_REFRESH_S  # the bar shows rank0_loss from the first step on
            desc = f"epoch {epoch + 1}" + (f"/{self.epochs}" if self.epochs else "")
            self._step_bar = self._tqdm(
                total=self.samples_per_epoch,
                initial=skipped_samples,
                desc=desc,
                unit="sample",
                unit_scale=True,
                file=self.stream,
                position=1,
                dynamic_ncols=True,
                leave=False,
            )

    def step(self, n_local: int, n_global: int, local_loss_sum: torch.Tensor) -> None:
        """After each optimizer step. `local_loss_sum`: this rank's summed loss so far this
        epoch, or [loss sum, count] (the count: samples, or the task's tokens)."""
        if self.mode == "off":
            return
        self._seen_local += n_local
        self._seen_global += n_global
        now = time.perf_counter()
        due = now - self._last_shown >= (BAR_REFRESH_S if self.mode == "bar" else self.line_interval)
        if due:
            self._last_shown = now
        if self.mode == "bar":
            self._step_bar.update(n_global)
            if due and self._seen_local:
                self._step_bar.set_postfix_str(f"rank0_loss {self._rank0_loss(local_loss_sum):.4f}")
        elif due:
            elapsed = now - self._t0
            if self.samples_per_epoch is None:  # a stream: no length, so steps and samples/s, no share or ETA
                parts = [f"epoch {self._epoch + 1}", f"{self._seen_global:,} samples"]
                if self._seen_local:
                    parts.append(f"rank0_loss {self._rank0_loss(local_loss_sum):.4f}")
                parts.append(self._speed(elapsed))
                print("  ".join(parts), file=self.stream, flush=True)
                return
            fraction = self._seen_global / self.samples_per_epoch
            parts = [f"epoch {self._epoch + 1}/{self.epochs}", f"{fraction:.0%} of the epoch"]
            if self._seen_local:
                parts.append(f"rank0_loss {self._rank0_loss(local_loss_sum):.4f}")
            parts.append(self._speed(elapsed))
            here = (self._seen_global - self._skipped) / self.samples_per_epoch  # this session's part of the epoch
            parts.append(f"eta {format_eta(self._eta(fraction, elapsed / here if here > 0 else 0.0))}")
            print("  ".join(parts), file=self.stream, flush=True)

    def end_epoch(self, record: dict[str, Any]) -> None:
        """After the epoch's global loss and eval are known: the epoch line, the run's ETA."""
        if self.mode == "off":
            return
        self._last_end = time.perf_counter()
        self._epochs_done_here += 1
        line = epoch_line(record, self.epochs, self.max_steps)
        if record.get("samples_per_s"):
            line += f"  samples/s {record['samples_per_s']:,.0f}" + rates_text(record)
        if self.epochs and record["epoch"] < self.epochs and self.samples_per_epoch is not None:
            line += f"  eta {format_eta(self._eta(1.0, 0.0))}"
        if self.mode == "lines":
            print(line, file=self.stream, flush=True)
            return
        self._step_bar.close()
        self._tqdm.write(line, file=self.stream)
        postfix = {"loss": f"{record['train_loss']:.4f}"}
        postfix.update({k[5:]: f"{v:.4f}" for k, v in record.items() if k.startswith("eval_") and k != "eval_loss"})
        self._epoch_bar.set_postfix(postfix, refresh=False)
        self._epoch_bar.update(1)

    def close(self) -> None:
        for bar in (self._step_bar, self._epoch_bar):
            if bar is not None:
                bar.close()
        self._step_bar = self._epoch_bar = None

    def _speed(self, elapsed: float) -> str:
        """`samples/s N` so far this epoch (+ tokens/s, TFLOP/s and MFU where they are known)."""
        if elapsed <= 0:
            return "samples/s -"
        samples_per_s = (self._seen_global - self._skipped) / elapsed
        rates = self.throughput.rates(samples_per_s) if self.throughput is not None else {}
        return f"samples/s {samples_per_s:,.0f}" + rates_text(rates)

    def _rank0_loss(self, local_loss_sum: torch.Tensor) -> float:
        if local_loss_sum.numel() == 2:
            loss, count = local_loss_sum.tolist()
            count -= self._count_offset
            return (loss - self._loss_offset) / count if count > 0 else float("nan")
        return (local_loss_sum.item() - self._loss_offset) / self._seen_local

    def _eta(self, fraction_of_epoch: float, epoch_pace_s: float) -> float:
        """Seconds to the end of the run: the rest of this epoch plus the epochs after it, at
        the mean pace of the epochs done so far (before any: `epoch_pace_s`, this epoch's)."""
        if self._epochs_done_here:
            epoch_pace_s = (self._last_end - (self._first_start or 0.0)) / self._epochs_done_here
        return ((1.0 - fraction_of_epoch) + (self.epochs - self._epoch - 1)) * epoch_pace_s


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
