"""A torchrun user's own DDP script: it never imports ddpkit. The tests of `ddpkit launch`'s guard
(launchers/bootstrap.py, script_guard.py) choose what goes wrong by environment variables:
  WHERE_OUT=FILE   each rank writes FILE.RANK: what python gave it (argv, cwd, sys.path[0],
                   __file__, __name__) and the process group's default timeout
  OWN_TIMEOUT=S    init_process_group(timeout=S seconds), the script's own
  HANG_RANK=R      rank R sleeps before the all-reduce of step 3
  GIL_RANK=R       rank R blocks there in a call that holds the GIL
  DIE_RANK=R       rank R kills itself (SIGKILL) at step 2 of the first attempt
  ABORT_RANK=R     rank R aborts after its last line (an atexit handler: the interpreter's teardown)
  SLOW_RANK=R      rank R finishes SLOW_S seconds after the others
  MISMATCH=1       after the steps, the ranks all-reduce tensors of different shapes
  BACKEND=NAME     the backend asked for (default gloo)
"""

import atexit
import ctypes
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def env_rank(name):
    return int(os.environ.get(name, "-1"))


own = {"timeout": timedelta(seconds=float(os.environ["OWN_TIMEOUT"]))} if os.environ.get("OWN_TIMEOUT") else {}
dist.init_process_group(os.environ.get("BACKEND", "gloo"), **own)
rank = dist.get_rank()
if os.environ.get("WHERE_OUT"):
    seen = {
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "path0": sys.path[0],
        "file": __file__,
        "name": __name__,
        "main_file": sys.modules["__main__"].__file__,
        "default_timeout": dist.distributed_c10d._get_default_timeout("gloo").total_seconds(),
    }
    with open(f"{os.environ['WHERE_OUT']}.{rank}", "w") as f:
        json.dump(seen, f)

torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 4))
for step in range(5):
    if rank == env_rank("HANG_RANK") and step == 3:  # asleep before the all-reduce of this step
        time.sleep(600)
    if rank == env_rank("GIL_RANK") and step == 3:
        r, w = os.pipe()
        ctypes.PyDLL(None).read(r, ctypes.create_string_buffer(1), 1)  # holds the GIL, waits for ever
    if rank == env_rank("DIE_RANK") and step == 2 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    model(torch.ones(2, 4)).sum().backward()
print(f"rank {rank}: 5 steps done (attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT')})", flush=True)
if os.environ.get("MISMATCH"):
    dist.all_reduce(torch.ones(3 + rank))
dist.barrier()
dist.destroy_process_group()
if rank == env_rank("SLOW_RANK"):
    time.sleep(float(os.environ.get("SLOW_S", "5")))
    print(f"rank {rank}: finished after the others", flush=True)
if rank == env_rank("ABORT_RANK"):
    atexit.register(os.abort)
