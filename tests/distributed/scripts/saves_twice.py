"""An own loop that saves into FOLDER SAVES times; after each save rank 0 says so (FOLDER/NAME-K),
and before the second it waits for the file GO: another job may save into FOLDER in between."""

import sys
import time
from pathlib import Path

import torch

import ddpkit

folder, name, saves, go = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
with ddpkit.init(device="cpu") as rt:
    model = rt.wrap(torch.nn.Linear(4, 2))
    for save in range(1, saves + 1):
        deadline = time.monotonic() + 120
        while save > 1 and not go.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        rt.save(str(folder / "ckpt.pt"), model, who=f"{name}-{save}")
        if rt.is_main:
            (folder / f"{name}-{save}").touch()
