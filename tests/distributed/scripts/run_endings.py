"""Wine runs that end in the ways `ddpkit runs` tells apart (selected by name)."""
import os
import signal

from ddpkit.tasks.wine import build as wine


def signals_itself(config=None):
    """Wine that sends itself SIGUSR1 after its first epoch: with --save-on-signal USR1 the run
    saves at the next step and stops, as under SLURM's time-limit warning."""
    task = wine(config)
    task.on_metrics = lambda record: os.kill(os.getpid(), signal.SIGUSR1) if record["epoch"] == 1 else None
    return task


class Fails:
    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, out, y):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("the task's loss failed at its third call")
        return self.inner(out, y)


def fails_at_step_3(config=None):
    task = wine(config)
    task.loss_fn = Fails(task.loss_fn)
    return task
