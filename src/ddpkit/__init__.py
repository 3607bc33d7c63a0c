"""ddpkit: one PyTorch training task on 1 process, every GPU of a node, or many nodes."""
from .api import init, memory_plan, train
from .checkpoint import atomic_save, load_file
from .config import RunConfig
from .data import ShardedLoader, eval_batches
from .env import DistEnv
from .errors import DdpkitError
from .parallel import unwrap, wrap_model
from .runtime import Runtime, all_sum, mean_across_ranks
from .task import Task

__all__ = [
    "DdpkitError", "DistEnv", "RunConfig", "Runtime", "ShardedLoader", "Task",
    "all_sum", "atomic_save", "eval_batches", "init", "load_file", "mean_across_ranks",
    "memory_plan", "train", "unwrap", "wrap_model",
]
__version__ = "0.1.0"
