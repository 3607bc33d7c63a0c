"""A task that prints from every rank while it is built, as nanoGPT's train.py does: many
long lines, never flushed by hand, so each process's buffer reaches the console in pieces."""
import os

from ddpkit.tasks.wine import build as wine


def build(config=None, lines: int = 200):
    rank = os.environ.get("RANK", "0")
    for i in range(lines):
        print(f"task rank {rank} line {i} " + "y" * 200)
    return wine(config)
