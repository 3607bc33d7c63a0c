"""Which samples each rank sees: one global order cut into global batches (training), and
contiguous unpadded slices (evaluation), so the world size never changes the result."""
from .sharding import ShardedLoader, eval_batches, global_order, shard_range, split_even

__all__ = ["ShardedLoader", "eval_batches", "global_order", "shard_range", "split_even"]
