"""rank_output.py: whole prefixed lines through a real pipe, silence off rank 0, sys.stdout back after."""

import io
import os
import sys

from ddpkit.reporting.rank_output import WholeLines, rank_stdout


def _read_all(fd):
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks).decode()


def test_pieces_of_a_line_go_out_as_one_prefixed_line():
    r, w = os.pipe()
    out = WholeLines(w, "[rank1]:")
    out.write("number of parameters: ")
    out.flush()  # a flush does not cut the line
    out.write("0.10M\nsecond")
    out.write(" line\nno newline at the end")
    out.finish()
    os.close(w)
    assert _read_all(r) == "[rank1]:number of parameters: 0.10M\n[rank1]:second line\n[rank1]:no newline at the end\n"
    os.close(r)
    assert not out.isatty()  # progress falls back to lines


def test_other_ranks_are_silent_and_stdout_comes_back(monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    saved = sys.stdout
    with rank_stdout(rank=1, world_size=2, verbose=False):
        print("from rank 1")
    with rank_stdout(rank=0, world_size=2, verbose=False):
        print("from rank 0")
    with rank_stdout(rank=1, world_size=1, verbose=False):
        print("alone")
    assert sys.stdout is saved and saved.getvalue() == "from rank 0\nalone\n"
