"""`ddpkit k8s`'s decisions (work in progress)."""

from __future__ import annotations


# What every pod's container runs
def pod_command(train_args: list[str], run_dir: str, python: str = "python") -> list[str]:
    return [
        python,
        "-m",
        "ddpkit",
        "train",
        *train_args,
        "--run-dir",
        run_dir,
        "--auto-resume",
        "--save-on-signal",
        "TERM",
    ]
