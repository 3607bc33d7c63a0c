"""The process group up and down, and the collectives of the job (shared memory or backend)."""

from .collectives import Collectives
from .devices import cuda_device_count, default_threads, resolve_backend, resolve_device_type, usable_cores
from .group import Runtime, all_sum, mean_across_ranks
from .record import CollectiveRecord

__all__ = [
    "CollectiveRecord",
    "Collectives",
    "Runtime",
    "all_sum",
    "cuda_device_count",
    "default_threads",
    "mean_across_ranks",
    "resolve_backend",
    "resolve_device_type",
    "usable_cores",
]
