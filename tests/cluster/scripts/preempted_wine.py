"""The Wine task with the same arithmetic, slowed down or held in its first run (no checkpoint in
RUN_DIR yet), so that a test can signal it while it trains or while it saves.

slow: seconds each forward pass sleeps (a real time limit's warning arrives mid-run; the resumed
run trains at full speed). hold_save=1: the first checkpoint waits, inside the save (the scheduler's
state), until this rank has received a SECOND stop signal (at most 60 s), and records that in
RUN_DIR/held-RANK.json; RUN_DIR/saving-RANK says the save has begun. The scheduler is constant
(factor 1.0: the learning rate is exactly the optimizer's), in both runs, so checkpoints agree."""

import json
import os
import signal
import time
from pathlib import Path

from torch.optim.lr_scheduler import LambdaLR

from ddpkit.tasks.wine import build as wine


def _constant(step):
    return 1.0


class HeldSave(LambdaLR):
    def __init__(self, optimizer, run_dir, hold):
        self.held_in, self.hold_first_save = str(run_dir), hold
        super().__init__(optimizer, _constant)

    def state_dict(self):
        if self.hold_first_save:
            self.hold_first_save = False
            rank = os.environ.get("SLURM_PROCID", "0")
            Path(self.held_in, f"saving-{rank}").write_text("")
            stop = getattr(signal.getsignal(signal.SIGUSR2), "__self__", None)  # ddpkit's StopRequest
            deadline = time.monotonic() + 60
            while stop is not None and stop.repeats < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            seen = {"first": stop and stop.received, "repeats": stop and stop.repeats}
            Path(self.held_in, f"held-{rank}.json").write_text(json.dumps(seen))
        state = super().state_dict()
        state.pop("held_in")
        state.pop("hold_first_save")
        return state


def build(config, slow="0", hold_save="0"):
    task = wine(config)
    run_dir = Path(config.run_dir)
    first_run = not any((run_dir / "checkpoints").glob("*"))
    task.scheduler = lambda optimizer: HeldSave(optimizer, run_dir, first_run and str(hold_save) == "1")
    if first_run and float(slow):
        task.model.register_forward_pre_hook(lambda module, args: time.sleep(float(slow)))
    return task
