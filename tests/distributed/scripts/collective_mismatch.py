"""A user bug: rank 1 enters an all_reduce that rank 0 never reaches. Must end, not hang."""
import os
import time

import torch
import torch.distributed as dist

import ddpkit

with ddpkit.init(timeout=5) as rt:
    if rt.rank == 1:
        dist.all_reduce(torch.ones(1))
    else:
        # never reaches the all_reduce and never ends by itself: only the 5 s collective
        # timeout can end the job (or its launcher's death, so a failed test leaves nothing)
        launcher = os.getppid()
        while os.getppid() == launcher:
            time.sleep(0.2)
