"""benchmarks/run.py on a machine without matplotlib: the suite's results stand (exit 0,
results.md and results.json written) and the plot is skipped with one line, not an error
after the whole run. One real variant (the guide's single-process Wine script, ~5 s) runs
under an interpreter where importing matplotlib fails."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from conftest import REPO

BLOCK = """import sys
class _NoMatplotlib:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "matplotlib":
            raise ImportError(f"No module named {name!r}")
sys.meta_path.insert(0, _NoMatplotlib())
"""


def test_the_suite_finishes_and_skips_the_plot_in_one_line_without_matplotlib(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCK)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    out = tmp_path / "out"
    argv = [sys.executable, "benchmarks/run.py", "--workload", "wine", "--only", "guide-single", "--repeats", "1"]
    proc = subprocess.run([*argv, "--out", str(out)], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    assert [line for line in text.splitlines() if re.search(r"\bplot\b", line, re.I)] == [
        f"plot skipped: matplotlib is not installed (pip install matplotlib to draw {out / 'results.png'})"
    ]
    assert "Traceback" not in text and not (out / "results.png").exists()
    assert "| guide-single | 1 | 1/1 |" in (out / "results.md").read_text()
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [(r["name"], r["ok"]) for r in runs] == [("guide-single", True)]
    assert f"wrote {out / 'results.md'}, {out / 'results.json'} (" in proc.stdout  # no results.png named
