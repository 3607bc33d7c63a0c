"""MLflow (--tracker mlflow): one MLflow run per ddpkit run, through MLflow's client (no
global active run). The settings are its parameters, every metrics.jsonl record's numbers
its metrics at the global step, where and how it ran its tags (ddpkit.*). A resume continues
the same MLflow run; the redone steps after the checkpoint are logged again at their steps
(MLflow keeps a metric's whole history). MLflow keeps a parameter's first value: a setting a
resume changed (a raised --epochs) is the tag ddpkit.resumed.NAME with the new value. The run
ends FINISHED, KILLED (stopped by a signal, with a checkpoint) or FAILED; under --quiet
MLflow's "View run" lines are not printed."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from ...config.output import TRACKERS
from ...util.envvars import MLFLOW_CLIENT_LIMITS, MLFLOW_EXPERIMENT_VAR, MLFLOW_QUIET_VAR, MLFLOW_URI_VAR
from .base import FAILED, FINISHED, STOPPED, SinkSettings
from .tracker import Tracker, flat_params, run_tags, task_name

_BATCH = 100  # MLflow takes at most 100 params, 100 tags and 1000 metrics in one call
_MAX_PARAM = 6000  # characters of a parameter's value
_MAX_METRICS = 1000  # metrics in one log_batch
STATUS = {FINISHED: "FINISHED", STOPPED: "KILLED", FAILED: "FAILED"}  # how the run ended, as MLflow says it


class MlflowSink(Tracker):
    name = "mlflow"
    package = TRACKERS["mlflow"]

    def start(self, settings: SinkSettings, old_id: dict[str, Any] | None) -> dict[str, Any]:
        from mlflow.entities import Param, RunTag

        old_id = old_id or {}
        if settings.output.quiet:
            os.environ.setdefault(MLFLOW_QUIET_VAR, "true")  # no "View run" lines: only errors
        client = self.client = _client(settings.output.tracker_uri or old_id.get("tracking_uri"))
        if getattr(self, "run_id", None) is None:  # not a retry of a start that created its run
            if old_id.get("run_id"):
                self.run_id = old_id["run_id"]
                client.update_run(self.run_id, status="RUNNING")
            else:
                name = settings.output.experiment or os.environ.get(MLFLOW_EXPERIMENT_VAR) or task_name(settings)
                experiment = client.get_experiment_by_name(name)
                exp_id = experiment.experiment_id if experiment else client.create_experiment(name)
                self.run_id = client.create_run(exp_id, run_name=self.run_dir.name).info.run_id
                self.keep_id({"run_id": self.run_id, "tracking_uri": client.tracking_uri})
        logged = client.get_run(self.run_id).data.params  # a parameter once logged cannot change (a resume)
        values = {_key(k): v[:_MAX_PARAM] for k, v in flat_params(settings.params).items()}
        params = [Param(k, v) for k, v in values.items() if k not in logged]
        tags = [RunTag(f"ddpkit.{k}", v) for k, v in run_tags(settings).items()]
        tags += [RunTag(f"ddpkit.resumed.{k}", v) for k, v in values.items() if k in logged and logged[k] != v]
        for i in range(0, max(len(params), len(tags)), _BATCH):
            client.log_batch(self.run_id, params=params[i : i + _BATCH], tags=tags[i : i + _BATCH])
        return {"run_id": self.run_id, "tracking_uri": client.tracking_uri}

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.log_many([(metrics, step)])

    def log_many(self, records: list[tuple[dict[str, float], int]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        while records:  # as many records as one call takes, removed once sent (a retry sends the rest)
            n, size = 1, len(records[0][0])
            while n < len(records) and size + len(records[n][0]) <= _MAX_METRICS:
                size, n = size + len(records[n][0]), n + 1
            metrics = [Metric(_key(k), v, now, step) for values, step in records[:n] for k, v in values.items()]
            for i in range(0, len(metrics), _MAX_METRICS):  # a record of more numbers than a call takes: in parts
                self.client.log_batch(self.run_id, metrics=metrics[i : i + _MAX_METRICS])
            del records[:n]

    def finish(self, ending: str = FINISHED) -> None:
        self.client.set_terminated(self.run_id, status=STATUS[ending])

    @classmethod
    def end_abandoned(cls, run_dir: Path, ending: str, running_only: bool = False) -> bool:
        try:
            kept = json.loads((Path(run_dir) / f"tracker-{cls.name}.json").read_text())
            os.environ.setdefault(MLFLOW_QUIET_VAR, "true")  # the launcher's own lines say what happened
            client = _client(kept.get("tracking_uri"))
            status = client.get_run(kept["run_id"]).info.status
            # rank 0 ends its run itself; stopped by torch's agent it cannot tell a signal to the
            # launcher from another rank's failure and says FAILED: a stop the launcher saw is KILLED
            if status != "RUNNING" and (running_only or not (ending == STOPPED and status == "FAILED")):
                return False
            client.set_terminated(kept["run_id"], status=STATUS[ending])
            return True
        except Exception:  # no such file, no server, no such run: nothing more to do than the run's own error
            return False


def _client(uri: str | None) -> Any:
    """MLflow's client of `uri` (else $MLFLOW_TRACKING_URI, else MLflow's default), with a few
    short retries per request, not minutes of them (unless the user set MLflow's own limits)."""
    for var, value in MLFLOW_CLIENT_LIMITS.items():
        os.environ.setdefault(var, value)  # MLflow's client reads them at each request
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri or os.environ.get(MLFLOW_URI_VAR) or None)


def _key(name: str) -> str:
    """A name MLflow accepts (letters, digits, _ - . space /)."""
    return re.sub(r"[^\w\-. /]", "_", name)
