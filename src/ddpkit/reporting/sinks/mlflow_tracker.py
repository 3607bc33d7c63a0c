"""MLflow (--tracker mlflow): one MLflow run per ddpkit run, through MLflow's client (no
global active run). The settings are its parameters, every metrics.jsonl record's numbers
its metrics at the global step, where and how it ran its tags (ddpkit.*). A resume continues
the same MLflow run; the redone steps after the checkpoint are logged again at their steps
(MLflow keeps a metric's whole history)."""

from __future__ import annotations

import os
import re
import time
from typing import Any, Mapping

from ...envvars import MLFLOW_CLIENT_LIMITS, MLFLOW_EXPERIMENT_VAR, MLFLOW_URI_VAR
from .tracker import Tracker, flat_params, run_tags, task_name

_BATCH = 100  # MLflow takes at most 100 params, 100 tags and 1000 metrics in one call
_MAX_PARAM = 6000  # characters of a parameter's value


class MlflowSink(Tracker):
    name = "mlflow"
    package = "mlflow"

    def start(self, settings: Mapping[str, Any], old_id: dict[str, Any] | None) -> dict[str, Any]:
        for var, value in MLFLOW_CLIENT_LIMITS.items():
            os.environ.setdefault(var, value)  # MLflow's client reads them at each request
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        old_id = old_id or {}
        uri = settings.get("tracker_uri") or old_id.get("tracking_uri") or os.environ.get(MLFLOW_URI_VAR) or None
        client = self.client = MlflowClient(tracking_uri=uri)
        if getattr(self, "run_id", None) is None:  # not a retry of a start that created its run
            if old_id.get("run_id"):
                self.run_id = old_id["run_id"]
                client.update_run(self.run_id, status="RUNNING")
            else:
                name = settings.get("experiment") or os.environ.get(MLFLOW_EXPERIMENT_VAR) or task_name(settings)
                experiment = client.get_experiment_by_name(name)
                exp_id = experiment.experiment_id if experiment else client.create_experiment(name)
                self.run_id = client.create_run(exp_id, run_name=self.run_dir.name).info.run_id
        logged = client.get_run(self.run_id).data.params  # a parameter once logged cannot change (a resume)
        params = [Param(_key(k), v[:_MAX_PARAM]) for k, v in flat_params(settings).items() if _key(k) not in logged]
        tags = [RunTag(f"ddpkit.{k}", v) for k, v in run_tags(settings).items()]
        for i in range(0, max(len(params), len(tags)), _BATCH):
            client.log_batch(self.run_id, params=params[i : i + _BATCH], tags=tags[i : i + _BATCH])
        return {"run_id": self.run_id, "tracking_uri": client.tracking_uri}

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(_key(k), v, now, step) for k, v in metrics.items()])

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


def _key(name: str) -> str:
    """A name MLflow accepts (letters, digits, _ - . space /)."""
    return re.sub(r"[^\w\-. /]", "_", name)
