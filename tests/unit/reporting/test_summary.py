"""The summary's run length: steps for a run by --max-steps, epochs for a run by epochs, both
where both matter."""

from ddpkit.reporting.progress import epoch_line
from ddpkit.reporting.summary import format_summary


def summary(**changes):
    s = {
        "world_size": 2,
        "nnodes": 1,
        "backend": "gloo",
        "device": "cpu",
        "batch_size": 16,
        "global_batch": 32,
        "accumulate": 1,
        "epochs": 100,
        "max_steps": None,
        "eval_every_steps": None,
        "save_every_steps": None,
        "epochs_done": 100,
        "steps_done": 500,
        "steps_planned": 500,
        "train_loss": 0.1,
        "eval_loss": None,
        "train_s": 1.0,
        "samples_per_s": 100.0,
        "stopped_early": False,
        "run_dir": "runs/x",
    }
    return format_summary({**s, **changes})


def batch_line(text):
    return next(line for line in text.splitlines() if "global batch" in line)


def test_a_run_by_steps_shows_its_steps_not_the_overridden_epochs():
    line = batch_line(summary(max_steps=30, epochs_done=1, steps_done=30, steps_planned=30))
    assert line.endswith("(16 per process), steps 30/30") and "epochs" not in line


def test_a_run_by_steps_over_several_passes_also_names_the_epoch_it_ended_in():
    assert batch_line(summary(max_steps=12, epochs_done=3, steps_done=12, steps_planned=12)).endswith(
        "steps 12/12, epoch 3"
    )


def test_a_run_by_epochs_shows_epochs_and_steps_only_where_they_matter():
    assert batch_line(summary()).endswith("(16 per process), epochs 100/100")
    assert batch_line(summary(eval_every_steps=50)).endswith("epochs 100/100, steps 500/500")
    stopped = batch_line(summary(stopped_early=True, epochs_done=3, steps_done=17))
    assert stopped.endswith("epochs 3/100, steps 17/500")


def test_a_stream_without_a_length_counts_steps_without_a_total():
    assert batch_line(summary(save_every_steps=5, epochs_done=1, epochs=1, steps_done=20, steps_planned=0)).endswith(
        "epochs 1/1, steps 20"
    )


def test_an_older_summary_without_step_counts_still_formats():
    s = {
        "world_size": 1,
        "nnodes": 1,
        "backend": "none",
        "device": "cpu",
        "batch_size": 32,
        "global_batch": 32,
        "epochs": 100,
        "epochs_done": 100,
        "train_loss": 0.1,
        "train_s": 1.0,
        "samples_per_s": 1.0,
        "run_dir": "r",
    }
    assert batch_line(format_summary(s)).endswith("(32 per process), epochs 100/100")


def test_epoch_lines_of_a_run_by_steps_show_the_steps():
    record = {"epoch": 2, "step": 10, "train_loss": 0.5}
    assert epoch_line(record, 3, max_steps=12) == "epoch 2/3  step 10/12  train_loss 0.5000"
    assert epoch_line(record, 3) == "epoch 2/3  train_loss 0.5000"  # a run by epochs: unchanged
    assert epoch_line(record, None, max_steps=100) == "epoch 2  step  10/100  train_loss 0.5000"


def test_a_slow_link_is_one_line_per_node_next_to_a_slow_rank():
    link = {"where": "link", "node": 1, "ranks": [2, 3], "ratio": 9.0, "link_mb_per_s": 3.5, "others_mb_per_s": 80}
    slow = {"rank": 0, "where": "data", "ratio": 2.0}
    lines = summary(stragglers=[slow, {"rank": 2, **link}, {"rank": 3, **link}]).splitlines()
    assert [line for line in lines if line.startswith("  slow")] == [
        "  slow rank    0: 2.0x the median rank's busy time per step, most in data",
        "  slow link    node 1 (ranks 2, 3): sent 3.5 MB/s, the other nodes 80.0 MB/s (median)",
    ]
