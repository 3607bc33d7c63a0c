"""The environment variables ddpkit itself reads or sets, by name. The launcher side (cli, api,
launchers) and the worker side (worker, reporting) both import them, so they sit at the bottom
layer, beside errors.py, and import nothing of ddpkit."""

from __future__ import annotations

import os
from pathlib import Path

# the user -> ddpkit: several ranks may share one GPU, over gloo (runtime/devices.py): to run the
# multi-rank CUDA paths on a machine with one GPU; NCCL itself is not exercised
SHARE_GPU_VAR = "DDPKIT_SHARE_GPU"
# the launcher -> its workers
ERROR_DIR_VAR = "DDPKIT_ERROR_DIR"  # where a worker writes a user error for the launcher to print
LAUNCH_TIME_VAR = "DDPKIT_LAUNCH_TIME"  # when the command started (the summary's wall time)
AGENT_START_VAR = "DDPKIT_AGENT_START_TIME"  # when the launcher handed over to torch's agent (the start-up's parts)
LAUNCH_ID_VAR = "DDPKIT_LAUNCH_ID"  # one `ddpkit train` (a token): the run directory's mark names it once started
SNAPSHOT_DIR_VAR = "DDPKIT_SNAPSHOT_DIR"  # this node's private folder for memory snapshots (checkpoint/snapshot.py)
STORE_FILE_VAR = "DDPKIT_STORE_FILE"  # one node: the workers' FileStore, this path + attempt (runtime/store.py)
RUN_URL_VAR = "DDPKIT_RUN_URL"  # the bucket a run is stored in; the run directory is then its staging folder
AGENT_PID_VAR = "DDPKIT_AGENT_PID"  # the launcher's process: a stop by a signal another node received is sent there
# `ddpkit slurm`'s batch script -> rank 0: after a warning signal's checkpoint write this file; the script requeues
REQUEUE_FILE_VAR = "DDPKIT_REQUEUE_FILE"
# `ddpkit slurm --exclude-slow`'s batch script -> rank 0: the record of the nodes named slow, check by check
SLOW_NODES_FILE_VAR = "DDPKIT_SLOW_NODES_FILE"
# torch's agent -> every worker: how many times it has restarted this node's workers, and how often it may
RESTART_COUNT_VAR = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS_VAR = "TORCHELASTIC_MAX_RESTARTS"
# `ddpkit launch` -> the bootstrap its workers start through (launchers/bootstrap.py)
TIMEOUT_VAR = "DDPKIT_TIMEOUT"  # --timeout: the default timeout of the script's process group
HANG_TIMEOUT_VAR = "DDPKIT_HANG_TIMEOUT"  # --hang-timeout, when given (else 2 x the group's timeout)
HANG_DIR_VAR = "DDPKIT_HANG_DIR"  # where the workers write hang reports
# what a launch's worker leaves in its attempt's error folder (error_file): the script returned
# (a later abort is torch's teardown, not the script's), and where its stacks go on STACK_SIGNAL
RETURNED_FILE = "returned-{rank}"
STACKS_FILE = "stacks-{rank}.txt"  # first line: "PID MAIN_THREAD_ID", then faulthandler's dumps
RESTARTED_FILE = "restarted-at"  # the launcher -> a restarted attempt: when the one before failed (training/ledger.py)
STOPPED_FILE = "stopped.json"  # a stop by a signal: which, at which step, received here or not (training/signals.py)


def restart_count() -> int:
    """How many times torch's agent has restarted this worker's group (0: the first attempt, or no agent)."""
    return int(os.environ.get(RESTART_COUNT_VAR, "0") or 0)


def max_restarts() -> int:
    """--max-restarts as torch's agent passed it to this worker (0 without an agent)."""
    return int(os.environ.get(MAX_RESTARTS_VAR, "0") or 0)


def attempt_errors(error_dir: str | Path, attempt: int) -> Path:
    """The folder of ERROR_DIR that one attempt's workers write to: after a restart, the files of an
    earlier attempt must not name the failure of a later one."""
    return Path(error_dir, f"attempt-{attempt}")


def ranks_with(folder: Path, pattern: str) -> set[int]:
    """The ranks whose file of `pattern` (RETURNED_FILE, STACKS_FILE) is in an attempt's `folder`."""
    prefix = pattern.split("{rank}")[0]
    found = set()
    for p in folder.glob(prefix + "*"):
        digits = p.name[len(prefix) :].split(".")[0]
        if digits.isdigit():
            found.add(int(digits))
    return found


def error_file(error_dir: str | Path, name: str) -> Path:
    """Where a worker leaves `name` (its one-line error) for the launcher: this attempt's folder."""
    folder = attempt_errors(error_dir, restart_count())
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


# a user or a benchmark -> ddpkit
BENCH_RESULT_VAR = "DDPKIT_BENCH_RESULT"  # set: rank 0 prints the summary as one `RESULT {json}` line
SLOW_EXIT_VAR = "DDPKIT_SLOW_EXIT"  # set: the CLI leaves through the interpreter's teardown, not os._exit
PROGRESS_INTERVAL_VAR = "DDPKIT_PROGRESS_INTERVAL"  # seconds between in-epoch progress lines (default 30)
# a benchmark -> ddpkit (training/profile.py): torch.profiler over optimizer steps A..B-1, files in DIR
PROFILE_STEPS_VAR = "DDPKIT_PROFILE_STEPS"  # A:B (1-based global steps, B excluded)
PROFILE_OUT_VAR = "DDPKIT_PROFILE_OUT"  # DIR: each rank writes DIR/rank{R}.json (Chrome trace) and .txt

# a user -> the experiment trackers (--tracker): their own variables, the defaults of ddpkit's flags
MLFLOW_URI_VAR = "MLFLOW_TRACKING_URI"  # MLflow's server when no --tracker-uri (else MLflow's own default)
MLFLOW_EXPERIMENT_VAR = "MLFLOW_EXPERIMENT_NAME"  # MLflow's experiment when no --experiment (else the task's name)
WANDB_PROJECT_VAR = "WANDB_PROJECT"  # W&B's project when no --experiment (else the task's name)
WANDB_DIR_VAR = "WANDB_DIR"  # where W&B writes its files (else RUN_DIR)
WANDB_SILENT_VAR = "WANDB_SILENT"  # ddpkit -> W&B under --quiet: none of its own lines
WANDB_MODE_VAR = "WANDB_MODE"  # offline: W&B writes the run for a later `wandb sync` (online needs its login)
MLFLOW_QUIET_VAR = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"  # ddpkit -> MLflow under --quiet: no "View run" lines
# ddpkit -> cuBLAS in a worker under --deterministic (runtime/determinism.py): a fixed workspace
CUBLAS_WORKSPACE_VAR = "CUBLAS_WORKSPACE_CONFIG"
# ddpkit -> MLflow's HTTP client, unless the user set them: a few short retries, not minutes of them
MLFLOW_CLIENT_LIMITS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
