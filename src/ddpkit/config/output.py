"""What rank 0 shows and writes: the run directory, the progress display, the metric files
and experiment trackers (reporting/sinks/; README: Trackers), an export at the end."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from ..errors import DdpkitError
from .settings import OUTPUT, Section, choice, setting

PROGRESS_MODES = ("auto", "bar", "lines")
# --tracker's choices, each with the package (= ddpkit extra) it needs: the one list of trackers;
# each sink in reporting/sinks/ takes its name and package from here (a unit test holds them equal)
TRACKERS: dict[str, str | None] = {"mlflow": "mlflow", "wandb": "wandb", "tensorboard": "tensorboard", "csv": None}
EXPORT_FORMATS = ("safetensors", "hf")  # what `ddpkit export` and train's --export write (checkpoint/export.py)


@dataclass(frozen=True)
class Output(Section):
    """Where the run's files go and what reports it: the display, metric files, trackers, the export."""

    GROUP = OUTPUT

    straggler_every: int = setting(
        100,
        "every N optimizer steps, compare where each rank's step time goes (data, compute, waiting) and name a "
        "rank slower than 1.2x the median (one small all-reduce per N steps; 0: only in the summary)",
        group=OUTPUT,
        metavar="N",
    )
    run_dir: str | None = setting(
        None, "where model.pt, metrics.jsonl and checkpoints/ go", group=OUTPUT, type=str, default_help="runs/TASK-TIME"
    )
    quiet: bool = setting(
        False, "no per-epoch progress or summary; only errors (the run directory still gets everything)", group=OUTPUT
    )
    progress: str = setting(
        "auto",
        "rank 0's progress: a tqdm bar, or plain lines for log files (on a GPU each refresh reads the running "
        "loss on the host: a synchronisation per refresh, not per step)",
        group=OUTPUT,
        choices=PROGRESS_MODES,
        default_help="auto: bar on a terminal",
    )
    csv: bool = setting(False, "also write RUN_DIR/metrics.csv (metrics.jsonl is always written)", group=OUTPUT)
    tensorboard: bool = setting(False, "also write TensorBoard event files to RUN_DIR/tensorboard", group=OUTPUT)
    export: str | None = setting(
        None,
        "at the end of the run, write the model to RUN_DIR/export/: safetensors files, or a folder "
        "Hugging Face's from_pretrained loads (hf; a transformers model); as `ddpkit export` does",
        group=OUTPUT,
        choices=EXPORT_FORMATS,
    )
    # experiment trackers (reporting/sinks/; README: Trackers): --csv and --tensorboard are two of them
    tracker: list[str] = setting(
        help="also send every metrics.jsonl record to this tracker, from rank 0; repeat for several",
        group=OUTPUT,
        choices=tuple(TRACKERS),
        append=True,
        type=str,
        factory=list,
    )
    tracker_uri: str | None = setting(
        None, "MLflow's tracking server (http://host:5000)", group=OUTPUT, type=str, default_help="$MLFLOW_TRACKING_URI"
    )
    experiment: str | None = setting(
        None,
        "the MLflow experiment or W&B project the run goes to",
        group=OUTPUT,
        type=str,
        default_help="$MLFLOW_EXPERIMENT_NAME or $WANDB_PROJECT, else the task's name",
    )

    def check(self) -> None:
        if not isinstance(self.straggler_every, int) or self.straggler_every < 0:
            raise DdpkitError(
                f"--straggler-every must be 0 or a positive number of steps, got {self.straggler_every!r}"
            )
        choice("--progress", self.progress, PROGRESS_MODES)
        if self.tensorboard and importlib.util.find_spec(TRACKERS["tensorboard"] or "") is None:
            raise DdpkitError(
                "--tensorboard needs the tensorboard package: pip install 'ddpkit[tensorboard]' (or tensorboard)"
            )
        for name in self.tracker:
            choice("--tracker", name, tuple(TRACKERS))
            package = TRACKERS[name]
            if package and importlib.util.find_spec(package) is None:
                raise DdpkitError(f"--tracker {name} needs the {package} package: pip install 'ddpkit[{package}]'")
        if self.tracker_uri and "mlflow" not in self.tracker:
            raise DdpkitError("--tracker-uri is MLflow's tracking server: add --tracker mlflow (or drop --tracker-uri)")
        if self.experiment and not {"mlflow", "wandb"} & set(self.tracker):
            raise DdpkitError(
                "--experiment names the MLflow experiment or W&B project: add --tracker mlflow or --tracker wandb "
                "(or drop --experiment)"
            )
        if self.export is not None:
            check_export_format("--export", self.export)


def check_export_format(flag: str, value: str) -> None:
    """An export's format, and the safetensors package it needs (refused before a run, not after)."""
    choice(flag, value, EXPORT_FORMATS)
    if importlib.util.find_spec("safetensors") is None:
        raise DdpkitError(f"{flag} needs the safetensors package: pip install 'ddpkit[export]' (or safetensors)")
