"""Wine whose every training forward sleeps PACED_WINE_STEP_S seconds (default 0): a run that
is still training when another one starts (the model is unchanged)."""

import os
import time

from ddpkit.tasks.wine import build as wine


def build(config=None):
    task = wine(config)
    pause = float(os.environ.get("PACED_WINE_STEP_S", "0"))
    if pause:
        task.model.register_forward_pre_hook(lambda module, args: time.sleep(pause) if module.training else None)
    return task
