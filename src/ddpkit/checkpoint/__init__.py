"""Save and resume, atomically, for either kind: one file written by rank 0 (file.py) or a
folder of shards written by every rank (sharded.py, FSDP); state.py: what both hold."""
from .file import atomic_save, load_file, load_state, save_state
from .state import Position, plain_state_dict, rng_state, set_rng_state, unwrap

__all__ = ["Position", "atomic_save", "load_file", "load_state", "plain_state_dict", "rng_state", "save_state", "set_rng_state", "unwrap"]
