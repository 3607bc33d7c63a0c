"""progress.py: which mode, what the lines say, no cross-rank work."""

import io

import torch

from ddpkit.reporting.progress import Progress, choose_mode, epoch_line, format_eta


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_mode_is_a_bar_on_a_terminal_lines_in_a_file_and_nothing_off_rank_0_or_quiet():
    assert choose_mode("auto", quiet=False, is_main=True, stream=Tty()) == "bar"
    assert choose_mode("auto", quiet=False, is_main=True, stream=io.StringIO()) == "lines"  # SLURM log file
    assert choose_mode("bar", quiet=False, is_main=True, stream=io.StringIO()) == "bar"
    assert choose_mode("lines", quiet=False, is_main=True, stream=Tty()) == "lines"
    assert choose_mode("auto", quiet=False, is_main=False, stream=Tty()) == "off"
    assert choose_mode("bar", quiet=True, is_main=True, stream=Tty()) == "off"


def test_without_tqdm_a_terminal_gets_plain_lines(monkeypatch):
    import ddpkit.reporting.progress as progress

    monkeypatch.setattr(progress, "find_spec", lambda name: None if name == "tqdm" else object())
    assert choose_mode("auto", quiet=False, is_main=True, stream=Tty()) == "lines"
    assert choose_mode("bar", quiet=False, is_main=True, stream=Tty()) == "lines"


def record(epoch):
    return {
        "epoch": epoch,
        "train_loss": 1.0 / epoch,
        "eval_loss": 0.5,
        "eval_accuracy": 0.75,
        "epoch_s": 0.1,
        "samples_per_s": 1234.5,
        "lr": 0.001,
    }


def test_epoch_line_keeps_the_parsed_format():
    assert epoch_line(record(3), 100) == "epoch   3/100  train_loss 0.3333  eval_loss 0.5000  eval_accuracy 0.7500"
    assert format_eta(59.6) == "1:00" and format_eta(3725) == "1:02:05"


def test_plain_lines_one_per_epoch_plus_in_epoch_lines_when_epochs_are_long(monkeypatch):
    monkeypatch.setenv("DDPKIT_PROGRESS_INTERVAL", "0")  # every step counts as a long wait
    out = io.StringIO()
    p = Progress("lines", epochs=2, start_epoch=0, samples_per_epoch=100, stream=out)
    for epoch in (0, 1):
        p.start_epoch(epoch)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for _ in range(2):
            loss_sum += 0.5 * 25
            p.step(25, 50, loss_sum)
        p.end_epoch(record(epoch + 1))
    p.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("epoch 1/2  50% of the epoch  rank0_loss 0.5000  samples/s ")
    assert lines[2].startswith(
        "epoch 1/2  train_loss 1.0000  eval_loss 0.5000  eval_accuracy 0.7500  samples/s 1,234  eta "
    )
    assert lines[5].startswith("epoch 2/2  train_loss 0.5000") and "eta" not in lines[5]  # nothing left to wait for
    assert len(lines) == 6


def test_a_short_epoch_prints_no_in_epoch_line_and_off_prints_nothing(monkeypatch):
    monkeypatch.setenv("DDPKIT_PROGRESS_INTERVAL", "inf")  # however slow this machine is, no in-epoch line falls due
    out = io.StringIO()
    p = Progress("lines", epochs=1, start_epoch=0, samples_per_epoch=10, stream=out)
    p.start_epoch(0)
    p.step(5, 10, torch.tensor(1.0))
    p.end_epoch(record(1))
    assert out.getvalue().splitlines() == [epoch_line(record(1), 1) + "  samples/s 1,234"]
    quiet = io.StringIO()
    p = Progress("off", epochs=1, start_epoch=0, samples_per_epoch=10, stream=quiet)
    p.start_epoch(0)
    p.step(5, 10, torch.tensor(1.0))
    p.end_epoch(record(1))
    p.close()
    assert quiet.getvalue() == ""


def test_the_step_path_reads_the_loss_tensor_only_when_a_display_is_due(monkeypatch):
    monkeypatch.setenv("DDPKIT_PROGRESS_INTERVAL", "inf")  # no line falls due, however slow the 1000 steps are

    class Counting(torch.Tensor):
        reads = 0

        def item(self):
            Counting.reads += 1
            return super().item()

    loss = torch.tensor(1.0).as_subclass(Counting)
    p = Progress("lines", epochs=1, start_epoch=0, samples_per_epoch=10**6, stream=io.StringIO())
    p.start_epoch(0)
    for _ in range(1000):
        p.step(1, 2, loss)
    assert Counting.reads == 0  # no line due: no read, no device sync on the hot path
