"""Weights & Biases (--tracker wandb): one W&B run per ddpkit run. The settings are its config,
every metrics.jsonl record's numbers are logged against `global_step` (the run's optimizer
steps, W&B's x axis for every metric), where and how it ran are its tags. WANDB_MODE=offline
writes the run under WANDB_DIR (default RUN_DIR) for a later `wandb sync`. A resume continues
the same W&B run (its id is kept in RUN_DIR/tracker-wandb.json) and updates the settings it
changed. A run that failed or was stopped by a signal ends with exit code 1 (W&B: failed); of a run
whose processes were all killed outright (SIGKILL) W&B has no end (online, its server marks
the run crashed when the run's heartbeat stops)."""

from __future__ import annotations

import os
from typing import Any

from ...config.output import TRACKERS
from ...util.envvars import WANDB_DIR_VAR, WANDB_MODE_VAR, WANDB_PROJECT_VAR, WANDB_SILENT_VAR
from .base import FINISHED, SinkSettings
from .tracker import Tracker, run_tags, task_name


class WandbSink(Tracker):
    name = "wandb"
    package = TRACKERS["wandb"]

    def start(self, settings: SinkSettings, old_id: dict[str, Any] | None) -> dict[str, Any]:
        if settings.output.quiet:
            os.environ.setdefault(WANDB_SILENT_VAR, "true")  # read when wandb loads: only errors
        import wandb

        if not self._logged_in(wandb):  # never an interactive prompt waiting in the background
            raise RuntimeError("no W&B credentials: `wandb login`, WANDB_API_KEY, or WANDB_MODE=offline")
        old_id = old_id or {}
        project = settings.output.experiment or old_id.get("project") or os.environ.get(WANDB_PROJECT_VAR)
        project = project or task_name(settings)
        run = self.run = wandb.init(
            project=project,
            id=old_id.get("id"),
            resume="allow" if old_id.get("id") else None,
            name=self.run_dir.name,
            dir=os.environ.get(WANDB_DIR_VAR) or str(self.run_dir),
            tags=[f"{k}:{v}"[:64] for k, v in run_tags(settings).items()],
            settings=wandb.Settings(console="off"),  # ddpkit's own output stays as it is
        )
        run.config.update(dict(settings.params), allow_val_change=True)  # a resume may change some (--epochs)
        run.define_metric("global_step")
        run.define_metric("*", step_metric="global_step")
        return {"id": run.id, "project": project}

    @staticmethod
    def _logged_in(wandb: Any) -> bool:
        if os.environ.get(WANDB_MODE_VAR, "online") in ("offline", "dryrun", "disabled"):
            return True
        try:
            return bool(wandb.login(prompt=False, verify=False))
        except TypeError:  # a wandb without `prompt`: its own login at init
            return True

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({**metrics, "global_step": step})

    def finish(self, ending: str = FINISHED) -> None:
        self.run.finish(exit_code=0 if ending == FINISHED else 1)  # W&B shows a non-zero exit as failed
