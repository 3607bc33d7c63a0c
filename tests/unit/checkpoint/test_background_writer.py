"""--async-save's writer (checkpoint/file.py: BackgroundWriter): training goes on while a
checkpoint is written, one write at a time, and a failed write is raised in the training
thread at the next wait (the next save, the end of the run, any error path)."""

import threading

import pytest

from ddpkit.checkpoint.file import BackgroundWriter


def test_submit_returns_while_writing_and_the_next_submit_waits_for_the_last_write():
    writer, log, release = BackgroundWriter(), [], threading.Event()

    def first():
        log.append("first starts")
        assert release.wait(timeout=60)
        log.append("first ends")

    writer.submit(first)  # returns although `first` cannot end yet: the write runs in its own thread
    second = threading.Thread(target=writer.submit, args=(lambda: log.append("second"),))
    second.start()
    second.join(timeout=0.5)
    assert second.is_alive() and "second" not in log  # held back until the first write ends
    release.set()
    second.join(timeout=60)
    writer.wait()
    assert log == ["first starts", "first ends", "second"]


def _fails():
    raise OSError("No space left on device")


def test_a_failed_write_is_raised_at_the_next_wait_once_and_the_writer_goes_on():
    writer, done = BackgroundWriter(), []
    writer.submit(_fails)
    with pytest.raises(OSError, match="No space left"):
        writer.wait()
    writer.wait()  # raised once, not again
    writer.submit(lambda: done.append("written"))
    writer.wait()
    assert done == ["written"]


def test_a_failed_write_is_raised_at_the_next_submit_which_then_writes_nothing():
    writer, done = BackgroundWriter(), []
    writer.submit(_fails)
    with pytest.raises(OSError, match="No space left"):
        writer.submit(lambda: done.append("written"))
    writer.wait()
    assert done == []
