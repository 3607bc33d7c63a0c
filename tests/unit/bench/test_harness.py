"""benchmarks/harness.py: the pieces every benchmark driver shares (start and time a command,
read its RESULT line, interleave variants, write a table, leave no run folder behind)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.fixture(scope="module")
def harness():
    spec = importlib.util.spec_from_file_location("bench_harness_unit", REPO / "benchmarks" / "harness.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """tempfile's folder pointed at an empty one, so a leaked run folder is seen."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_the_run_folder_is_removed_when_the_run_is_interrupted(harness, private_tmp, monkeypatch):
    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(subprocess, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        harness.run_cmd("x", ["{python}", "-c", "pass"])
    assert list(private_tmp.iterdir()) == []


def test_the_run_folder_is_removed_when_collect_is_interrupted(harness, private_tmp):
    def collect(tmp):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        harness.run_cmd("x", ["{python}", "-c", "print('RESULT {\"a\": 1}')"], collect=collect)
    assert list(private_tmp.iterdir()) == []


def test_variants_interleave_round_by_round(harness):
    assert [f"{r}{v}" for r, v in harness.interleave("AB", 2)] == ["0A", "0B", "1A", "1B"]
    assert [f"{r}{v}" for r, v in harness.interleave("ABC", 3, mirror=True)] == (
        ["0A", "0B", "0C", "1C", "1B", "1A", "2A", "2B", "2C"]
    )


def test_the_last_well_formed_result_line_wins(harness):
    text = 'noise\nRESULT {"a": 1}\nRESULT {broken\n  RESULT {"a": 2, "b": "x"}  \ntail'
    assert harness.parse_result(text) == {"a": 2, "b": "x"}
    assert harness.parse_result("no result here") is None


def test_a_run_is_started_timed_and_read(harness, private_tmp):
    """One real command: its RESULT fields, wall and CPU time from outside, a run folder it
    may use ({tmp}, given to collect before it is removed) and a log file."""
    code = "import os, time; t = time.process_time()\nwhile time.process_time() - t < 0.2: pass\n"
    code += "open(os.path.join('{tmp}', 'mark'), 'w').write('7')\n"
    code += 'print("RESULT {\\"wall_s\\": 0.5, \\"train_loss\\": 0.25, \\"fit_end_s\\": 0.0}")'
    seen = []
    res = harness.run_cmd(
        "v",
        ["{python}", "-c", code],
        collect=lambda tmp: seen.append(tmp) or {"mark": int(open(f"{tmp}/mark").read())},
        log_dir=str(private_tmp / "logs"),
    )
    assert res["ok"] and res["rc"] == 0 and res["mark"] == 7
    assert res["inner_wall_s"] == 0.5 and res["final_loss"] == 0.25  # the alias of ddpkit's name
    assert res["cpu_s"] >= 0.2 and res["wall_s"] >= res["cpu_s"] * 0.5 and res["teardown_s"] >= 0
    assert sorted(p.name for p in private_tmp.iterdir()) == ["logs"]  # the run folder is gone
    assert (private_tmp / "logs" / "v.0.log").read_text().startswith(f"$ {sys.executable} -c")


def test_a_failed_run_says_why_and_require_stops_the_driver(harness):
    res = harness.run_cmd("bad", ["{python}", "-c", "import sys; print('boom'); sys.exit(3)"])
    assert not res["ok"] and res["rc"] == 3 and res["error"] == "no RESULT line; boom"
    with pytest.raises(SystemExit, match=r"^bad failed \(rc=3\): no RESULT line; boom$"):
        harness.require(res)
    assert harness.require({"ok": True, "name": "x"}) == {"ok": True, "name": "x"}


def test_the_table_writers(harness):
    assert harness.spread([3.0, 1.0, 2.0], ".1f") == "2.0 (1.0-3.0)"
    lines = harness.md_table(["a", "b"], [[1, "x"], ["y", 2.5]])
    assert lines == ["| a | b |", "|---|---|", "| 1 | x |", "| y | 2.5 |"]
    runs = [
        {"name": "base", "ok": True, "wall_s": 10.0, "world_size": 2, "repeat": 0},
        {"name": "new", "ok": True, "wall_s": 5.0, "world_size": 2, "repeat": 0},
        {"name": "base", "ok": True, "wall_s": 12.0, "world_size": 2, "repeat": 1},
        {"name": "new", "ok": False, "wall_s": 1.0, "rc": 1, "error": "x", "repeat": 1},
    ]
    assert harness.table(runs, ["base"]).splitlines() == [
        "| variant | procs | ok/runs | wall s | wall s ÷ base |",
        "|---|---|---|---|---|",
        "| base | 2 | 2/2 | 11.0 (10.0-12.0) | 1.00x |",
        "| new | 2 | 1/2 | 5.00 | 0.45x |",
        "",
        "FAILED new (repeat 1): rc=1 x",
    ]
