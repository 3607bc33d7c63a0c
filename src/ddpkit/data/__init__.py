"""Which samples each rank sees: one global order cut into global batches (training),
contiguous unpadded slices (evaluation), so the world size never changes the result; and
streams (streams.py), dealt out by shard or round-robin, resumable from their position."""

from .loaders import rank_loader
from .sharding import ShardedLoader, eval_batches, global_order, shard_range, split_even
from .streams import ShardedStream, StreamLoader, is_stream, read_jsonl, read_lines, read_tar

__all__ = [
    "ShardedLoader",
    "ShardedStream",
    "StreamLoader",
    "eval_batches",
    "global_order",
    "is_stream",
    "rank_loader",
    "read_jsonl",
    "read_lines",
    "read_tar",
    "shard_range",
    "split_even",
]
