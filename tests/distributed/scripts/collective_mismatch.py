"""A user bug: rank 1 enters an all_reduce that rank 0 never reaches. Must end, not hang."""
import time

import torch
import torch.distributed as dist

import ddpkit

with ddpkit.init(timeout=5) as rt:
    if rt.rank == 1:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(60)
