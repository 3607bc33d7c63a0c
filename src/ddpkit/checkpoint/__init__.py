"""A run's checkpoints: the checkpointer (checkpointer.py) owns them; one schema (schema.py) for
either kind: one file written by rank 0 (file.py) or a folder of shards written by every rank
(sharded.py, FSDP); state.py: the position, RNG and weights both hold."""

from .file import atomic_save, load_file
from .state import Position, plain_state_dict, rng_state, set_rng_state, unwrap

__all__ = [
    "Position",
    "atomic_save",
    "load_file",
    "plain_state_dict",
    "rng_state",
    "set_rng_state",
    "unwrap",
]
