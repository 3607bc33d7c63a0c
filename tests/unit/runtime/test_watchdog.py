"""The hang summary, from reports written by hand (no processes): who waits where, who never arrived."""

import json
import os
import time

import torch

from ddpkit.runtime.hang_summary import format_summary, hang_line
from ddpkit.runtime.watchdog import dumped_frames, is_timeout, write_dumped_report

TORCH = os.path.dirname(torch.__file__)  # a frame inside torch (a backward waiting in DDP's all-reduce)


def entry(
    seq,
    op="all_reduce",
    shape=(4,),
    path="shm",
    state="waiting",
    user="",
    caller="ddpkit/training/step.py:183 in flags",
):
    return {
        "seq": seq,
        "op": op,
        "shape": list(shape),
        "dtype": "float64",
        "path": path,
        "what": "",
        "caller": caller,
        "user": user,
        "started": time.time() - 3,
        "state": state,
        "seconds": None,
    }


def write(d, rank, collectives, stack=()):
    d.mkdir(exist_ok=True)
    (d / f"rank-{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "host": "n1",
                "pid": 1,
                "time": time.time(),
                "reason": f"rank {rank} made no progress",
                "main_stack": [{"file": f, "line": n, "function": fn, "code": c} for f, n, fn, c in stack],
                "collectives": collectives,
                "flight_recorder": None,
            }
        )
    )


def test_a_rank_outside_any_collective_never_arrived(tmp_path):
    write(tmp_path, 0, [entry(11, state="done"), entry(12)])
    write(tmp_path, 1, [entry(11, state="done")], [("/x/train.py", 40, "forward", "time.sleep(600)")])
    text = format_summary(tmp_path, 2)
    assert "rank 0   [n1] waiting in all_reduce #12 (shape [4], float64, shm)" in text
    assert "rank 1   [n1] in no collective (last: all_reduce #11" in text and "x/train.py:40 in forward" in text
    assert "verdict: rank(s) 1 never arrived at all_reduce #12" in text


def test_different_collectives_and_missing_ranks_are_named(tmp_path):
    write(tmp_path, 0, [entry(18, shape=(3,), path="backend", user="train.py:82 in forward")])
    write(tmp_path, 1, [entry(18)])
    assert "the same sequence number, different collectives" in format_summary(tmp_path, 2)
    text = format_summary(tmp_path, 3)
    assert "rank 2   no report" in text and "rank(s) 2 did not report" in text


def test_timeouts_are_told_from_other_errors():
    assert is_timeout(RuntimeError("[gloo] Timed out waiting 3000ms for recv operation to complete"))
    assert is_timeout(RuntimeError("rank 0 waited 3 s (--timeout) for rank 1 to reach the same all-reduce"))
    assert not is_timeout(ValueError("bad shape"))


def test_a_collective_only_the_flight_recorder_saw_counts_as_waiting(tmp_path):
    backward = [("/x/train.py", 12, "step", "loss.backward()"), (f"{TORCH}/autograd/graph.py", 9, "run", "run()")]
    write(tmp_path, 0, [entry(11, state="done")], backward)
    report = json.loads((tmp_path / "rank-0.json").read_text())
    report["flight_recorder"] = {
        "0": {
            "last_enqueued": 20,
            "last_completed": 19,
            "pending": {"op": "gloo:all_reduce", "sizes": [[1091]], "seq": 20},
        }
    }
    (tmp_path / "rank-0.json").write_text(json.dumps(report))
    write(tmp_path, 1, [entry(11, state="done")], [("/x/data.py", 7, "__getitem__", "read()")])
    text = format_summary(tmp_path, 2)
    assert "rank 0   [n1] waiting in gloo:all_reduce #20 (shape [1091]" in text
    assert "rank(s) 1 never arrived at gloo:all_reduce #20" in text and "x/data.py:7 in __getitem__" in text


def test_a_collective_the_flight_recorder_marks_late_is_no_wait_while_the_rank_runs_its_own_code(tmp_path):
    """gloo's entries can show a finished broadcast as not completed yet: a rank asleep in the user's
    forward is outside any collective, and the verdict names it as the one that never arrived."""
    write(tmp_path, 0, [entry(11, state="done"), entry(12)])
    write(tmp_path, 1, [entry(11, state="done")], [("/x/train.py", 40, "forward", "time.sleep(600)")])
    report = json.loads((tmp_path / "rank-1.json").read_text())
    report["flight_recorder"] = {
        "0": {"last_enqueued": 9, "last_completed": 8, "pending": {"op": "gloo:broadcast", "sizes": [[1]], "seq": 9}}
    }
    (tmp_path / "rank-1.json").write_text(json.dumps(report))
    text = format_summary(tmp_path, 2)
    assert "rank 1   [n1] in no collective" in text and "x/train.py:40 in forward" in text, text
    assert "verdict: rank(s) 1 never arrived at all_reduce #12" in text, text


def test_the_line_that_ends_a_hung_job_names_the_rank_that_hung_not_the_one_that_waited(tmp_path):
    write(tmp_path, 0, [entry(11, state="done"), entry(12, user="train.py:30 in step")])
    write(tmp_path, 1, [entry(11, state="done")], [("/x/train.py", 40, "forward", "time.sleep(600)")])
    line = hang_line(tmp_path, 2)
    assert line.startswith("rank 1 hung at x/train.py:40 in forward: time.sleep(600): it never reached all_reduce #12")
    assert "in which rank 0 waited" in line and line.endswith(f"every rank's stacks and collectives are in {tmp_path}")
    assert "(first reported: rank 0 made no progress)" in line


def test_the_line_of_a_hang_without_one_culprit_says_what_the_ranks_were_doing(tmp_path):
    write(tmp_path, 0, [entry(12, user="train.py:30 in step")])
    write(tmp_path, 1, [entry(12, op="broadcast", user="train.py:31 in step")])
    assert hang_line(tmp_path, 2).startswith(
        "the ranks disagree on the collective: rank 0 in all_reduce #12 at train.py:30 in step; "
        "rank 1 in broadcast #12 at train.py:31 in step"
    )
    write(tmp_path, 1, [entry(12, user="train.py:30 in step")])
    assert hang_line(tmp_path, 2).startswith("every rank waits in all_reduce #12: the process group is stuck")
    assert hang_line(tmp_path, 3).startswith("rank(s) 2 did not report")


def test_a_faulthandler_dump_gives_the_main_threads_frames_outermost_first(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import time\n\ntime.sleep(600)\n")
    dump = (
        "Thread 0x00007f0000000001 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 331 in wait\n\n'
        "Current thread 0x00007f0000000002 (most recent call first):\n"
        f'  File "{script}", line 3 in <module>\n'
        '  File "/x/ddpkit/launchers/bootstrap.py", line 70 in run_file\n'
    )
    frames = dumped_frames(dump, 0x7F0000000002)
    assert [(f["line"], f["function"]) for f in frames] == [(70, "run_file"), (3, "<module>")]
    assert frames[-1]["code"] == "time.sleep(600)" and frames[-1]["file"] == str(script)
    write_dumped_report(tmp_path / "hang", 1, 4242, 0x7F0000000002, dump, "rank 1 did not answer")
    report = json.loads((tmp_path / "hang" / "rank-1.json").read_text())
    assert report["pid"] == 4242 and report["main_stack"] == frames and report["collectives"] == []
    assert dump in (tmp_path / "hang" / "rank-1.txt").read_text()


def _reporter(hang_dir, world=2):
    from ddpkit.runtime.record import CollectiveRecord
    from ddpkit.runtime.watchdog import HangWatchdog

    return HangWatchdog(hang_dir, 0, world, 3.0, launcher_prints=True, record=CollectiveRecord())


def test_a_report_another_rank_of_this_attempt_began_is_not_moved_aside(tmp_path):
    """Two ranks that hang together both report first: the folder rank 1 just made (no request
    written yet) is this attempt's, not an earlier one's, and stays where the launcher reads it."""
    hang = tmp_path / "hang"
    write(hang, 1, [entry(12)])
    _reporter(hang)._report("rank 0 made no progress for 3 s")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hang"]
    assert {"rank-0.json", "rank-1.json", "request", "summary.txt"} <= {p.name for p in hang.iterdir()}


def test_an_earlier_attempts_report_moves_aside_when_this_one_hangs_before_its_start(tmp_path):
    hang = tmp_path / "hang"
    write(hang, 1, [entry(12)])
    (hang / "request").write_text("an hour ago\n")
    os.utime(hang / "request", (time.time() - 3600, time.time() - 3600))
    _reporter(hang, world=1)._report("rank 0 made no progress for 3 s")
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("hang-")]
    assert len(moved) == 1 and (moved[0] / "rank-1.json").exists(), list(tmp_path.iterdir())
    assert (hang / "request").read_text() == "rank 0 made no progress for 3 s\n"


def test_the_watchdog_thread_never_ends_a_rank_whose_main_thread_is_reporting(tmp_path, monkeypatch):
    """A rank whose collective timed out reports from its main thread (on_error) and stays alive
    until rank 0 has every report. Its own watchdog thread, between its poll's check of `reported`
    and its look for a request, can find the request that main thread has just written: it must
    leave the report to the main thread, not end the process before rank 0 has answered."""
    from ddpkit.runtime.record import CollectiveRecord
    from ddpkit.runtime.watchdog import HangWatchdog

    hang = tmp_path / "hang"
    ended = []
    monkeypatch.setattr(HangWatchdog, "_end_job", lambda self, reason: ended.append(reason))

    def main_thread_reports_now():  # the main thread's on_error, at this point of the thread's poll
        with wd._lock:
            wd.reported = True
        hang.mkdir()
        (hang / "request").write_text("rank 1: RuntimeError: Timed out waiting 5000ms\n")
        return "progress"

    wd = HangWatchdog(
        hang, 1, 2, None, launcher_prints=True, record=CollectiveRecord(), progress=main_thread_reports_now
    )
    wd._run()  # one poll: it finds the request
    assert ended == [] and not (hang / "rank-1.json").exists()  # rank 1's report and exit are its main thread's
