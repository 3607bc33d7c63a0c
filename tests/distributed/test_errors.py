"""Bad input: one line that says what was wrong and what to do, exit code 2, no worker left."""

import os
import shutil
import subprocess

import pytest

from conftest import REPO, run_ddpkit

BAD_TASKS = """
import torch
def wrong():
    return 42
def other_model():
    m = torch.nn.Linear(13, 3)
    ds = torch.utils.data.TensorDataset(torch.randn(40, 13), torch.randint(0, 3, (40,)))
    return ds, m, torch.optim.SGD(m.parameters(), lr=0.1)
def crashes():
    raise RuntimeError("bug in the user's task")
"""


def _no_process_mentions(marker: str) -> bool:
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    return [p for p in out if int(p) != os.getpid()] == []


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--nproc", "0"], "must be a positive integer"),
        (["--nproc", "-2"], "must be a positive integer"),
        (["--nproc", "100000"], "open files per process"),
        (["--backend", "nccl"], "--backend nccl needs a CUDA GPU"),
        (["--device", "cuda"], "--device cuda was asked for but no CUDA GPU"),
        (["no_such_task"], "unknown task"),
        (["no_such_module_q:build"], "not found"),
        (["json:nope"], "has no function 'nope'"),
        (["--resume"], "--resume needs --run-dir"),
    ],
)
def test_refused_before_any_worker_starts(tmp_path, args, fragment):
    proc = run_ddpkit("train", *args, "--epochs", "1", cwd=tmp_path, check=False, timeout=60)
    assert proc.returncode == 2
    assert fragment in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # no usage wall


IMPORT_FAILURES = {  # file name -> text: a task file with a stray word, and a module whose helper raises
    "broken.py": "import torch\n\ngarbage\n\n\ndef build():\n    return None\n",
    "broken_mod.py": "from broken_helper import extension\n\n\ndef build():\n    return None\n",
    "broken_helper.py": "def load():\n    raise ImportError('no compiled extension here')\n\n\nextension = load()\n",
}


@pytest.mark.parametrize(
    "spec, first_line, frames",
    [
        (
            "broken.py:build",
            "task file 'broken.py' failed at import: NameError: name 'garbage' is not defined",
            [("broken.py", 3, "<module>", "garbage")],
        ),
        (
            "broken_mod:build",
            "task module 'broken_mod' failed at import: ImportError: no compiled extension here",
            [
                ("broken_mod.py", 1, "<module>", "from broken_helper import extension"),
                ("broken_helper.py", 5, "<module>", "extension = load()"),
                ("broken_helper.py", 2, "load", "raise ImportError('no compiled extension here')"),
            ],
        ),
    ],
)
def test_a_task_that_fails_at_import_is_one_line_and_the_users_own_frames(tmp_path, spec, first_line, frames):
    for name, text in IMPORT_FAILURES.items():
        (tmp_path / name).write_text(text)
    proc = run_ddpkit("train", spec, "--epochs", "1", cwd=tmp_path, check=False, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == f"ddpkit: error: {first_line}"
    expected = []
    for name, line, function, code in frames:
        expected += [f'  File "{tmp_path / name}", line {line}, in {function}', f"    {code}"]
    assert [ln for ln in lines[1:] if not set(ln.strip()) <= set("^~")] == expected  # (3.11+ marks the call with ^)
    assert "Traceback" not in proc.stderr and str(REPO / "src") not in proc.stderr and "importlib" not in proc.stderr


@pytest.mark.parametrize(
    "task, extra, fragment",
    [
        ("bad.py:wrong", [], "returned int"),
        ("bad.py:other_model", ["--resume", "--run-dir", "prev"], "checkpoint is of a different model"),
        ("wine", ["--resume", "--run-dir", "empty"], "no checkpoint in"),
    ],
)
def test_errors_found_in_the_workers_are_one_clean_line(tmp_path, reference_run, task, extra, fragment):
    (tmp_path / "bad.py").write_text(BAD_TASKS)
    if "prev" in extra:  # a finished Wine run with its checkpoints (test_train's, copied)
        wine = reference_run("--nproc", "1", "--seed", "5", "--save-every", "2", "--epochs", "6", "--quiet")
        shutil.copytree(wine, tmp_path / "prev")
    proc = run_ddpkit(
        "train",
        task,
        "--nproc",
        "2",
        "--epochs",
        "1",
        "--seed",
        "0",
        *extra,
        "--timeout",
        "30",
        "--threads",
        "1",
        "--eval-every",
        "1",
        cwd=tmp_path,
        check=False,
        timeout=90,
    )
    assert proc.returncode == 2, proc.stderr
    assert fragment in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("ddpkit: error: ")


def test_a_crash_in_user_code_names_the_rank_and_stops_every_worker(tmp_path):
    (tmp_path / "bad.py").write_text(BAD_TASKS)
    run_dir = tmp_path / f"crashrun{os.getpid()}"
    proc = run_ddpkit(
        "train", "bad.py:crashes", "--nproc", "2", "--run-dir", str(run_dir), cwd=tmp_path, check=False, timeout=90
    )
    assert proc.returncode == 1  # a crash, not a usage error
    assert "bug in the user's task" in proc.stderr  # the failing rank's own traceback
    assert "ddpkit: error: worker rank" in proc.stderr
    assert _no_process_mentions(run_dir.name)
