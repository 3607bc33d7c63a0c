"""Joins a gloo process group, then rank 0 fails in user code (rank 1 leaves cleanly): torch's
exception hook writes each traceback line as `[rank0]: ...`."""
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 0:
    print("rank 0 about to fail", flush=True)
    None.missing_attribute  # noqa: B018  (an AttributeError, as in a real script's bug)
dist.destroy_process_group()
