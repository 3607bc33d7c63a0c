"""TensorBoard event files (--tensorboard) in RUN_DIR/tensorboard: scalars at the run's optimizer
step, as MLflow and W&B plot them (an evaluation inside an epoch has its own x), loss/train,
loss/eval, eval/<metric>, perf/..., run/epoch. On resume, events after the checkpoint's step
from the interrupted run are purged."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from .base import FINISHED, MetricSink, ResumePoint, SinkSettings


class TensorBoardSink(MetricSink):
    name = "tensorboard"
    TAGS = {
        "train_loss": "loss/train",
        "eval_loss": "loss/eval",
        "samples_per_s": "perf/samples_per_s",
        "tokens_per_s": "perf/tokens_per_s",
        "tflops_per_device": "perf/tflops_per_device",
        "mfu": "perf/mfu",
        "epoch_s": "perf/epoch_s",
        "lr": "optim/lr",
    }

    def open(self, run_dir: Path, settings: SinkSettings, resume: ResumePoint) -> None:
        from torch.utils.tensorboard import SummaryWriter  # only when asked for: tensorboard is an extra

        # the events the checkpoint does not hold (a record without a step is at its epoch)
        purge = resume.step + 1 if resume.step else resume.epoch + 1 if resume.epoch else None
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), purge_step=purge)

    def write(self, record: Mapping[str, Any], global_step: int | None) -> None:
        step = global_step if global_step is not None else record["epoch"]
        for key, value in record.items():
            if key == "step" or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            tag = self.TAGS.get(key) or (f"eval/{key[5:]}" if key.startswith("eval_") else f"run/{key}")
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self, ending: str = FINISHED) -> None:
        self.writer.close()
