"""--tracker: a real two-process run sends its metrics.jsonl to a real MLflow tracking server
(started here), to W&B in offline mode, to metrics.csv and to TensorBoard; each is read back
with the tracker's own client or format, and a --resume continues the same tracker runs. A
tracker server that is down costs a warning, never the run."""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from conftest import REPO, assert_state_close, load_model, run_ddpkit

mlflow_client = pytest.importorskip("mlflow.tracking", reason="needs the mlflow extra (pip install 'ddpkit[mlflow]')")
wandb_proto = pytest.importorskip("wandb.proto.wandb_internal_pb2", reason="needs the wandb extra")

QUIET_CLIENTS = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1", "WANDB_SILENT": "true"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    """A real MLflow tracking server on a free port (sqlite store), for this module's tests."""
    home = tmp_path_factory.mktemp("mlflow")
    port = _free_port()
    server = subprocess.Popen(
        [Path(sys.executable).parent / "mlflow", "server", "--backend-store-uri", f"sqlite:///{home}/mlflow.db"]
        + ["--default-artifact-root", str(home / "artifacts"), "--host", "127.0.0.1", "--port", str(port)]
        + ["--workers", "1"],
        stdout=open(home / "server.log", "w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, **QUIET_CLIENTS, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},  # no job workers
        start_new_session=True,  # its workers in its own group, stopped together below
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # a loaded machine takes long to import it
        while True:
            assert server.poll() is None, (home / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the MLflow server did not answer within 300 s"
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        finally:
            try:
                os.killpg(server.pid, signal.SIGKILL)  # whatever of its group is left
            except ProcessLookupError:
                pass
            server.wait()


def _train(run: Path, uri: str, wandb_dir: Path, *more: str) -> subprocess.CompletedProcess:
    trackers = [a for name in ("mlflow", "wandb", "csv", "tensorboard") for a in ("--tracker", name)]
    return run_ddpkit(
        *["train", "wine", "--nproc", "2", "--batch-size", "16", "--eval-every-steps", "3", "--quiet"],
        *[*trackers, "--tracker-uri", uri, "--experiment", "ddpkit-test", "--run-dir", str(run), *more],
        env={**QUIET_CLIENTS, "WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir)},
        timeout=400,
    )


def _numbers(records, key):
    return [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]


def _assert_same(got, expected, what=""):
    """(step, value) pairs: the same steps, the same values up to float rounding."""
    assert [s for s, _ in got] == [s for s, _ in expected], what
    assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6), what


@pytest.mark.slow
def test_every_tracker_gets_every_record_at_its_step_and_a_resume_continues_the_same_runs(tmp_path, mlflow_uri):
    run, wandb_dir = tmp_path / "run", tmp_path / "wandb"
    assert "View run" not in _train(run, mlflow_uri, wandb_dir, "--epochs", "2").stdout  # --quiet: MLflow's too
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("train_loss" not in r for r in records)  # evaluations inside an epoch: step-level records
    run_id = json.loads((run / "tracker-mlflow.json").read_text())["run_id"]
    wandb_id = json.loads((run / "tracker-wandb.json").read_text())["id"]

    # MLflow, through its own client: the settings, every record's numbers at their steps, the tags
    client = mlflow_client.MlflowClient(mlflow_uri)
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED"
    assert client.get_experiment(got.info.experiment_id).name == "ddpkit-test"
    assert {k: got.data.params[k] for k in ("task", "epochs", "batch_size", "tracker")} == {
        "task": "wine",
        "epochs": "2",
        "batch_size": "16",
        "tracker": "mlflow,wandb,csv,tensorboard",
    }
    assert {k: v for k, v in got.data.tags.items() if k.startswith("ddpkit.")} == {
        "ddpkit.world_size": "2",
        "ddpkit.strategy": "ddp",
        "ddpkit.precision": "fp32",
        "ddpkit.ddpkit_version": "0.1.0",
        "ddpkit.torch_version": torch.__version__,
    }
    for key in ("train_loss", "eval_loss", "eval_accuracy", "lr", "epoch"):
        history = [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
        _assert_same(sorted(history), _numbers(records, key), key)

    # csv and TensorBoard: the same records
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    _assert_same([(int(r["step"]), float(r["eval_loss"])) for r in rows], _numbers(records, "eval_loss"))
    tb = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = tb.EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    # at the optimizer step, as MLflow and W&B: an evaluation inside an epoch has its own x
    _assert_same([(e.step, e.value) for e in acc.Scalars("loss/train")], _numbers(records, "train_loss"))
    _assert_same([(e.step, e.value) for e in acc.Scalars("loss/eval")], _numbers(records, "eval_loss"))

    # W&B offline: its run file, read with its own record format
    runs = _wandb_runs(wandb_dir)
    assert [r["id"] for r in runs] == [wandb_id] and runs[0]["project"] == "ddpkit-test"
    assert {"world_size:2", "strategy:ddp", "precision:fp32"} <= set(runs[0]["tags"])
    assert runs[0]["config"]["epochs"] == 2
    history = [(h["global_step"], h["train_loss"]) for h in runs[0]["history"] if "train_loss" in h]
    _assert_same(history, _numbers(records, "train_loss"))

    # --resume with one more epoch: the same MLflow and W&B runs go on
    _train(run, mlflow_uri, wandb_dir, "--epochs", "3", "--resume")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["epoch"] for r in records) == 3
    assert json.loads((run / "tracker-mlflow.json").read_text())["run_id"] == run_id
    resumed = client.get_run(run_id)
    assert resumed.info.status == "FINISHED"
    # MLflow keeps a parameter's first value: what the resume changed is a tag with the new one
    assert (resumed.data.params["epochs"], resumed.data.tags["ddpkit.resumed.epochs"]) == ("2", "3")
    assert "ddpkit.resumed.batch_size" not in resumed.data.tags  # only what changed
    history = [(m.step, m.value) for m in client.get_metric_history(run_id, "train_loss")]
    _assert_same(sorted(history), _numbers(records, "train_loss"))
    assert len(client.search_runs([got.info.experiment_id])) == 1
    runs = _wandb_runs(wandb_dir)
    assert [r["id"] for r in runs] == [wandb_id, wandb_id]  # a second offline file of the same run
    assert [h["global_step"] for h in runs[1]["history"]] == [r["step"] for r in records if r["epoch"] == 3]
    assert runs[1]["config"]["epochs"] == 3  # W&B's config takes the changed setting

    # the run's config.json replays it, trackers and all: a new run of each tracker, the same model
    replay = tmp_path / "replay"
    run_ddpkit(
        *["train", "--config", str(run / "config.json"), "--run-dir", str(replay)],
        env={**QUIET_CLIENTS, "WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir)},
        timeout=400,
    )
    replayed = json.loads((replay / "config.json").read_text())
    assert replayed == {**json.loads((run / "config.json").read_text()), "run_dir": str(replay), "resume": False}
    assert_state_close(load_model(replay), load_model(run))  # 3 epochs at once = 2, then 1 more by a resume
    assert (replay / "metrics.csv").is_file() and list((replay / "tensorboard").iterdir())
    replay_id = json.loads((replay / "tracker-mlflow.json").read_text())["run_id"]
    assert replay_id != run_id and client.get_run(replay_id).info.status == "FINISHED"
    assert client.get_run(replay_id).data.params["tracker"] == "mlflow,wandb,csv,tensorboard"
    assert len(_wandb_runs(wandb_dir)) == 3


@pytest.mark.slow
def test_a_tracker_server_that_is_down_is_one_warning_and_the_run_finishes(tmp_path):
    run = tmp_path / "run"
    proc = run_ddpkit(
        *["train", "wine", "--nproc", "2", "--epochs", "2", "--quiet", "--run-dir", str(run)],
        *["--tracker", "mlflow", "--tracker-uri", f"http://127.0.0.1:{_free_port()}"],  # nobody listens there
        env=QUIET_CLIENTS,
        timeout=300,  # a hang fails the test
    )
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("ddpkit: warning:")]
    assert len(warnings) == 1 and warnings[0].startswith("ddpkit: warning: --tracker mlflow could not start its run")
    assert "training goes on without it" in warnings[0]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2] and (run / "model.pt").exists()
    assert not (run / "tracker-mlflow.json").exists()


def _wandb_runs(wandb_dir: Path) -> list[dict]:
    """Each offline W&B run under `wandb_dir`, oldest first: its id, project, tags, config and
    history rows. wandb (0.31) has no public reader of its .wandb files, so this reads their
    framing (a LevelDB-style log of 32 KiB blocks) and parses each record with wandb's own
    protobuf message, wandb_internal_pb2.Record."""
    out = []
    for path in sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb")):
        run: dict = {"config": {}, "history": []}
        for record in _wandb_records(path.read_bytes()):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run.update(id=record.run.run_id, project=record.run.project, tags=list(record.run.tags))
            elif kind == "config":
                run["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
            elif kind == "exit":
                run["exit_code"] = record.exit.exit_code
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                run["history"].append({k: v for k, v in row.items() if not k.startswith("_")})
        out.append(run)
    return out


def _wandb_records(data: bytes) -> list:
    assert data[:4] == b":W&B", data[:7]
    records, pos, pieces, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        pieces += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            records.append(wandb_proto.Record.FromString(pieces))
            pieces = b""
    return records


ENDINGS = REPO / "tests" / "distributed" / "scripts" / "run_endings.py"


@pytest.mark.slow
def test_a_run_that_fails_dies_or_stops_ends_its_tracker_run_so(tmp_path, mlflow_uri):
    """The task raises (rank 0 marks its runs failed), rank 0 dies outright (the launcher marks
    the MLflow run it left running), a signal stops the run with a checkpoint, or Ctrl-C without
    one (killed); never a run left RUNNING, and under --quiet no "View run" line of MLflow's."""
    client = mlflow_client.MlflowClient(mlflow_uri)
    wandb_dir = tmp_path / "wandb"

    def train(name, task, *more):
        proc = run_ddpkit(
            *[
                "train",
                f"{ENDINGS}:{task}",
                "--nproc",
                "2",
                "--epochs",
                "3",
                "--quiet",
                "--run-dir",
                str(tmp_path / name),
            ],
            *["--tracker", "mlflow", "--tracker-uri", mlflow_uri, "--experiment", "ddpkit-endings", *more],
            env={**QUIET_CLIENTS, "WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir)},
            timeout=400,
            check=False,
        )
        assert "View run" not in proc.stdout
        run_id = json.loads((tmp_path / name / "tracker-mlflow.json").read_text())["run_id"]
        return proc, client.get_run(run_id).info.status

    proc, status = train("raises", "fails_at_step_3", "--tracker", "wandb")
    assert proc.returncode != 0 and "the task's loss failed at its third call" in proc.stderr
    assert status == "FAILED"
    [wandb_run] = _wandb_runs(wandb_dir)
    assert wandb_run["exit_code"] == 1

    proc, status = train("dies", "rank_0_dies")
    assert proc.returncode != 0 and "worker rank 0 exited with code 3" in proc.stderr
    assert status == "FAILED"

    proc, status = train("stops", "signals_itself", "--save-on-signal", "USR1")
    assert proc.returncode == 0 and status == "KILLED"

    # Ctrl-C without --save-on-signal: rank 0, stopped by torch's agent, cannot tell why; the launcher can
    run = tmp_path / "ctrl-c"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "train", "--nproc", "2", "--epochs", "1000", "--quiet", "--run-dir", str(run)]
        + ["--tracker", "mlflow", "--tracker-uri", mlflow_uri, "--experiment", "ddpkit-endings"],
        env={**os.environ, **QUIET_CLIENTS, "PYTHONPATH": str(REPO / "src")},
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (run / "tracker-mlflow.json").exists() or len(_lines(run / "metrics.jsonl")) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: the launcher and every worker
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "stopped by SIGINT" in err and "View run" not in out
    run_id = json.loads((run / "tracker-mlflow.json").read_text())["run_id"]
    assert client.get_run(run_id).info.status == "KILLED"


def _lines(path):
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def _killed_while_training(run: Path, uri: str, *more: str) -> str:
    """`ddpkit train --tracker mlflow` in one process, SIGKILLed once it has saved a checkpoint
    and logged: nothing of it can end its MLflow run. The MLflow run's id."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "train", "--nproc", "1", "--epochs", "1000", "--save-every", "1", "--quiet"]
        + ["--run-dir", str(run), "--tracker", "mlflow", "--tracker-uri", uri, "--experiment", "ddpkit-kill9", *more],
        env={**os.environ, **QUIET_CLIENTS, "PYTHONPATH": str(REPO / "src")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (run / "tracker-mlflow.json").exists() or len(_lines(run / "metrics.jsonl")) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.communicate()
    return json.loads((run / "tracker-mlflow.json").read_text())["run_id"]


@pytest.mark.slow
def test_a_run_killed_without_a_word_has_its_mlflow_run_marked_killed_by_runs_and_by_resume(tmp_path, mlflow_uri):
    """kill -9 of the launcher leaves the MLflow run RUNNING, as nothing of the run is left to end
    it; the next `ddpkit runs` of its folder (its rank 0's process gone) marks it KILLED, MLflow's
    own status, with one line, and says nothing the next time; a --resume does the same before
    it continues that MLflow run, which then ends FINISHED."""
    client = mlflow_client.MlflowClient(tracking_uri=mlflow_uri)
    runs = tmp_path / "runs"
    run_id = _killed_while_training(runs / "listed", mlflow_uri)
    assert client.get_run(run_id).info.status == "RUNNING"
    line = (
        f"ddpkit: {runs / 'listed'}: killed without a word (its rank 0 is gone); "
        "its MLflow run, left RUNNING, is marked KILLED"
    )
    listed = run_ddpkit("runs", str(runs), env=QUIET_CLIENTS, timeout=120)
    assert listed.stderr.strip().splitlines() == [line], listed.stderr
    assert client.get_run(run_id).info.status == "KILLED"
    again = run_ddpkit("runs", str(runs), env=QUIET_CLIENTS, timeout=120)
    assert again.stderr.strip() == "" and "listed" in again.stdout, again.stderr

    resumed = runs / "resumed"
    run_id = _killed_while_training(resumed, mlflow_uri)
    assert client.get_run(run_id).info.status == "RUNNING"
    steps = max(json.loads(r).get("step", 0) for r in _lines(resumed / "metrics.jsonl"))
    proc = run_ddpkit(
        "train", "--nproc", "1", "--epochs", "1000", "--max-steps", str(steps + 3), "--quiet", "--resume",
        "--run-dir", str(resumed), "--tracker", "mlflow", "--tracker-uri", mlflow_uri, "--experiment", "ddpkit-kill9",
        env=QUIET_CLIENTS, timeout=120,
    )  # fmt: skip
    assert f"{line.replace('listed', 'resumed')}; this resume continues it" in proc.stderr.splitlines(), proc.stderr
    assert client.get_run(run_id).info.status == "FINISHED"
