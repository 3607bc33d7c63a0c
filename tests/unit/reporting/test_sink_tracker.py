"""What every tracker shares (reporting/sinks/tracker.py), on a tracker that keeps its calls in
a list: records reach it with their global steps, its run id is kept for a resume, and a
tracker that fails is a warning with a bounded number of tries, never an error of the run."""

import json

import pytest

from ddpkit.cli import build_parser
from ddpkit.cli.flags import config_from
from ddpkit.config import RunConfig
from ddpkit.errors import DdpkitError
from ddpkit.reporting.metrics import MetricsLog
from ddpkit.reporting.sinks import SINKS, ResumePoint, SinkSettings, Tracker, wanted_sinks
from ddpkit.reporting.sinks.tracker import flat_params, numbers, run_tags, task_name


class ListTracker(Tracker):
    """A tracker whose service is a list; `fails` calls of each kind fail first."""

    name = "listed"
    package = "json"
    retry_wait_s = 0.0

    def __init__(self, fails=0, fail_forever=False):
        self.calls, self.fails, self.fail_forever = [], fails, fail_forever

    def _maybe_fail(self, what):
        if self.fail_forever or self.fails > 0:
            self.fails -= 1
            raise ConnectionError(f"{what}: connection refused")

    def start(self, settings, old_id):
        self._maybe_fail("start")
        self.calls.append(("start", old_id))
        return {"run_id": (old_id or {}).get("run_id", "run-1")}

    def log(self, metrics, step):
        self._maybe_fail("log")
        self.calls.append(("log", step, metrics))

    def finish(self, ending="finished"):
        self.calls.append(("finish", ending))


RECORDS = [
    {"epoch": 1, "step": 2, "eval_loss": 0.9, "lr": 0.1},  # an evaluation inside epoch 1
    {"epoch": 1, "step": 4, "train_loss": 0.8, "samples_per_s": None, "stopped": True},
    {"epoch": 2, "step": 8, "train_loss": 0.5, "eval_loss": float("nan")},
]


def _run(tracker, run_dir, settings=None):
    tracker.open(run_dir, settings or SinkSettings(), ResumePoint())
    for r in RECORDS:
        tracker.write(r, r["step"])
    tracker.close()
    return tracker.calls


def test_every_record_reaches_the_tracker_at_its_global_step_and_its_run_id_is_kept(tmp_path):
    calls = _run(ListTracker(fails=1), tmp_path)  # the first try of each call fails: retried
    assert calls == [
        ("start", None),
        ("log", 2, {"epoch": 1.0, "eval_loss": 0.9, "lr": 0.1}),
        ("log", 4, {"epoch": 1.0, "train_loss": 0.8}),  # None and flags are not metrics
        ("log", 8, {"epoch": 2.0, "train_loss": 0.5}),  # nor a NaN
        ("finish", "finished"),
    ]
    assert json.loads((tmp_path / "tracker-listed.json").read_text()) == {"run_id": "run-1"}


def test_a_resume_continues_the_kept_run_and_a_fresh_run_does_not(tmp_path):
    (tmp_path / "tracker-listed.json").write_text('{"run_id": "old"}')
    resumed = [SinkSettings.of(RunConfig(run_dir="r", **{flag: True})) for flag in ("resume", "auto_resume")]
    assert [_run(ListTracker(), tmp_path, s)[0] for s in resumed] == [("start", {"run_id": "old"})] * 2
    assert _run(ListTracker(), tmp_path, SinkSettings.of(RunConfig(run_dir="r")))[0] == ("start", None)


def test_a_tracker_that_keeps_failing_is_one_warning_and_bounded_tries(tmp_path, capsys):
    tracker = ListTracker(fail_forever=True)
    calls = _run(tracker, tmp_path)
    assert calls == [] and tracker.fails == -tracker.tries  # start tried `tries` times, then nothing more
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "ddpkit: warning: --tracker listed could not start its run after 3 tries (ConnectionError: start: "
        "connection refused); training goes on without it (metrics.jsonl has every record)"
    ]
    assert not (tmp_path / "tracker-listed.json").exists()


def test_a_tracker_that_fails_later_stops_there_and_warns_once(tmp_path, capsys):
    class FailsAtStepFour(ListTracker):
        def log(self, metrics, step):
            if step == 4:
                raise OSError("disk full")
            super().log(metrics, step)

    calls = _run(FailsAtStepFour(), tmp_path)
    assert [c[:2] for c in calls] == [("start", None), ("log", 2)]  # nothing after the failure, not even finish
    assert capsys.readouterr().err.count("warning: --tracker listed could not log metrics after 3 tries") == 1


def test_tracker_choices_and_the_old_flags_are_one_setting():
    assert RunConfig(tracker=["csv"]).csv and RunConfig(tracker="tensorboard").tensorboard
    assert RunConfig(csv=True, tensorboard=True).tracker == ["csv", "tensorboard"]
    assert RunConfig(tracker=["mlflow", "csv", "mlflow"], csv=True).tracker == ["mlflow", "csv"]
    with pytest.raises(DdpkitError, match="--tracker must be one of mlflow, wandb, tensorboard, csv, got 'neptune'"):
        RunConfig(tracker=["neptune"])
    ns = build_parser().parse_args(["train", "--tracker", "mlflow", "--tracker", "csv", "--tensorboard"])
    assert config_from(ns).tracker == ["mlflow", "csv", "tensorboard"] and config_from(ns).csv
    settings = SinkSettings.of(RunConfig(tracker=["csv", "wandb"]))
    assert [cls.name for cls in wanted_sinks(settings)] == ["jsonl", "csv", "wandb"]
    assert {cls.name for cls in SINKS} >= {"jsonl", "csv", "tensorboard", "mlflow", "wandb"}


@pytest.mark.parametrize("name", ["mlflow", "wandb"])
def test_a_tracker_without_its_package_is_refused_with_what_to_install(monkeypatch, name):
    import ddpkit.config as config

    monkeypatch.setattr(config.importlib.util, "find_spec", lambda package: None)
    wanted = rf"--tracker {name} needs the {name} package: pip install 'ddpkit\[{name}\]'"
    with pytest.raises(DdpkitError, match=wanted):
        RunConfig(tracker=[name])


def test_a_tracker_through_metrics_log_only_on_rank_0(tmp_path):
    log = MetricsLog(tmp_path, enabled=False, settings=SinkSettings.of(RunConfig(tracker=["mlflow"])))
    log.write(dict(RECORDS[0]))
    log.close()
    assert list(tmp_path.iterdir()) == []  # other ranks open no tracker


def test_settings_become_flat_text_parameters_and_the_task_names_the_experiment():
    params = flat_params({"epochs": 3, "task_args": {"hidden": 64}, "tracker": ["mlflow", "csv"], "lr": None})
    assert params == {"epochs": "3", "task_args.hidden": "64", "tracker": "mlflow,csv", "lr": "None"}
    tasks = ("wine", "examples/my_task.py:make", "pkg.mod:build", "")
    assert [task_name(SinkSettings(config={"task": t})) for t in tasks] == [
        "wine",
        "my_task",
        "mod",
        "ddpkit",
    ]
    assert numbers({"step": 3, "epoch": 1, "x": True, "y": "a", "z": 2.5}) == {"epoch": 1.0, "z": 2.5}


def test_a_tracker_is_told_the_output_section_and_logs_every_setting_with_the_world_size():
    cfg = RunConfig(tracker=["mlflow"], tracker_uri="http://127.0.0.1:5000", experiment="e", quiet=True, epochs=7)
    settings = SinkSettings.of(cfg, world_size=4)
    assert settings.output == cfg.output and settings.output.tracker_uri == "http://127.0.0.1:5000"
    assert settings.params == {**cfg.as_dict(), "world_size": 4} and not settings.resuming
    tags = run_tags(settings)
    assert (tags["world_size"], tags["strategy"], tags["precision"]) == ("4", "ddp", "fp32")


def test_the_cli_refuses_a_missing_tracker_package_in_one_line_before_any_worker(monkeypatch, capsys, tmp_path):
    import ddpkit.config as config
    from ddpkit.cli import main

    monkeypatch.setattr(config.importlib.util, "find_spec", lambda package: None)
    assert main(["train", "--tracker", "mlflow", "--run-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == (
        "ddpkit: error: --tracker mlflow needs the mlflow package: pip install 'ddpkit[mlflow]'\n"
    )
    assert not (tmp_path / "run").exists()  # no worker started, nothing written


def test_records_waiting_behind_a_slow_start_are_sent_together(tmp_path):
    """The end of a run waits for the tracker's queue: what piled up goes in one call, not one each."""
    import threading

    class SlowStart(ListTracker):
        def __init__(self):
            super().__init__()
            self.go = threading.Event()

        def start(self, settings, old_id):
            assert self.go.wait(30)  # a service still starting: every record of the run queues behind it
            return super().start(settings, old_id)

        def log_many(self, records):
            self.calls.append(("log_many", [step for _, step in records]))
            records.clear()

    tracker = SlowStart()
    tracker.open(tmp_path, SinkSettings(), ResumePoint())
    for r in RECORDS:
        tracker.write(r, r["step"])
    tracker.go.set()
    tracker.close()
    assert tracker.calls == [("start", None), ("log_many", [2, 4, 8]), ("finish", "finished")]


def test_a_batch_that_fails_part_way_is_retried_from_where_it_stopped(tmp_path):
    class FailsOnceAtStepFour(ListTracker):
        def log(self, metrics, step):
            if step == 4 and not getattr(self, "failed_once", False):
                self.failed_once = True
                raise ConnectionError("reset")
            super().log(metrics, step)

    tracker = FailsOnceAtStepFour()
    tracker.open(tmp_path, SinkSettings(), ResumePoint())
    for r in RECORDS:
        tracker.write(r, r["step"])
    tracker.close()
    assert [c[1] for c in tracker.calls if c[0] == "log"] == [2, 4, 8]  # step 2 once, not again with the retry


@pytest.mark.parametrize("ending", ["finished", "stopped", "failed"])
def test_the_tracker_run_ends_as_the_run_did(tmp_path, ending):
    tracker = ListTracker()
    tracker.open(tmp_path, SinkSettings(), ResumePoint())
    tracker.write(RECORDS[0], 2)
    tracker.close(ending)
    assert tracker.calls[-1] == ("finish", ending)


def test_tracker_uri_and_experiment_without_their_tracker_are_refused_in_one_line(tmp_path, capsys):
    from ddpkit.cli import main

    with pytest.raises(DdpkitError, match="--tracker-uri is MLflow's tracking server: add --tracker mlflow"):
        RunConfig(tracker_uri="http://127.0.0.1:5000", tracker=["wandb"])
    with pytest.raises(DdpkitError, match="--experiment names the MLflow experiment or W&B project"):
        RunConfig(experiment="x", csv=True)
    assert RunConfig(tracker_uri="http://127.0.0.1:5000", experiment="x", tracker=["mlflow"]).experiment == "x"
    assert main(["train", "--tracker-uri", "http://127.0.0.1:5000", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "add --tracker mlflow" in err and not (tmp_path / "run").exists()
