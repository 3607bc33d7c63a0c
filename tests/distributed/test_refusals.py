"""A refusal writes nothing: every refusal before training leaves the run directory exactly as it
was (a finished run stays finished: its config.json unchanged, no failed.json, no moved report),
and a new run directory that a refusal would have left empty is not there at all."""

import hashlib
import os
import shutil
import time
from pathlib import Path

import pytest

from conftest import run_ddpkit

WINE = ("--nproc", "2", "--seed", "5", "--save-every", "2", "--epochs", "4", "--quiet")
TASKS = """
import torch
def other_model():
    m = torch.nn.Linear(13, 5)
    ds = torch.utils.data.TensorDataset(torch.randn(40, 13), torch.randint(0, 5, (40,)))
    return ds, m, torch.optim.SGD(m.parameters(), lr=0.1)
def takes(width=3):
    m = torch.nn.Linear(13, width)
    ds = torch.utils.data.TensorDataset(torch.randn(40, 13), torch.randint(0, 3, (40,)))
    return ds, m, torch.optim.SGD(m.parameters(), lr=0.1)
"""


def fingerprint(folder: Path) -> dict[str, tuple]:
    """Every entry under `folder`: its kind, size, modification time and content."""
    out = {}
    for path in sorted(folder.rglob("*")):
        st = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
        out[str(path.relative_to(folder))] = (path.is_dir(), st.st_size, st.st_mtime_ns, digest)
    return out


@pytest.fixture
def finished(tmp_path, reference_run):
    """A finished Wine run (2 processes, checkpoints every 2 epochs, an old hang report), copied."""
    run = tmp_path / "finished"
    shutil.copytree(reference_run(*WINE), run)
    (run / "hang").mkdir()
    (run / "hang" / "request").write_text("an earlier attempt's hang\n")
    # as old as an earlier attempt's is: the launcher takes a request from less than 1 s before its
    # start for one of its own (launchers/report.py), and a fast start came within that
    hour_ago = time.time() - 3600
    os.utime(run / "hang" / "request", (hour_ago, hour_ago))
    (tmp_path / "tasks.py").write_text(TASKS)
    return run


def _refused(cwd: Path, *args: str) -> str:
    proc = run_ddpkit("train", *args, "--timeout", "60", cwd=cwd, check=False, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ddpkit: error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return errors[0]


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("tasks.py:other_model", "--resume"), "checkpoint is of a different model"),
        (("wine", "--resume", "--lr-schedule", "cosine"), "this run has an LR scheduler"),
        (("wine", "--resume", "--init-from", "nowhere.pt"), "nowhere.pt"),
        (("wine", "--resume", "--export", "hf"), "hf"),
    ],
)
def test_a_refused_resume_leaves_the_finished_run_as_it_was(finished, args, fragment):
    before = fingerprint(finished)
    line = _refused(finished.parent, *args, "--nproc", "2", "--epochs", "6", "--run-dir", str(finished))
    assert fragment in line
    assert fingerprint(finished) == before
    runs = run_ddpkit("runs", str(finished)).stdout
    assert "finished" in runs.splitlines()[1] and "failed" not in runs


@pytest.mark.parametrize(
    "task, extra, fragment",
    [
        ("wine", ("--init-from", "nowhere.pt"), "nowhere.pt"),
        ("tasks.py:other_model", ("--init-from", "FINISHED/model.pt"), "the weights of another model"),
        ("tasks.py:takes", ("--task-arg", "depth=3"), "depth"),
        ("syntax.py:build", (), "syntax.py"),
    ],
)
def test_a_refused_new_run_leaves_no_run_directory(finished, task, extra, fragment):
    cwd = finished.parent
    (cwd / "syntax.py").write_text("def build(:\n    return None\n")
    extra = tuple(a.replace("FINISHED", str(finished)) for a in extra)
    target = cwd / "new" / "run"
    assert fragment in _refused(cwd, task, *extra, "--nproc", "2", "--epochs", "1", "--run-dir", str(target))
    assert not (cwd / "new").exists()
