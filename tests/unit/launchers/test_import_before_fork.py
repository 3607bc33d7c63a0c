"""What the launcher imports before forking its workers must leave it safe to fork: no
thread started by the import (a forked child would inherit a thread pool it cannot use)."""

import subprocess
import sys

from conftest import REPO

PROBE = """
import os, sys
import torch, torch.distributed
before = sorted(os.listdir('/proc/self/task'))
assert 'torch._dynamo' not in sys.modules
from ddpkit.launchers.elastic import import_before_fork
import_before_fork()
assert 'torch._dynamo' in sys.modules
after = sorted(os.listdir('/proc/self/task'))
print(len(before), len(after))
"""


def test_the_imports_before_fork_load_dynamo_and_start_no_thread():
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={"PYTHONPATH": str(REPO / "src")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    before, after = out.stdout.split()
    assert after == before
