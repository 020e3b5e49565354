"""Training checkpoints: a driver-side store of atomic, pruned checkpoint directories, and the per-rank
save/load of each policy's Megatron model, optimizer and RNG states inside them.

Typical use (driver, then every rank of every policy, then driver)::

    store = CheckpointStore(cfg.checkpoint.save_dir, cfg.checkpoint.keep_last)
    staging = store.begin(step)
    save_rank_state(staging, "policy", engine)          # on every rank of the policy, collectively
    store.commit(staging, step, {"step": step, ...})     # driver, after all ranks have returned

    path = store.resolve(args.resume)                    # 'latest' / True / a path
    state = store.load_state(path)
    load_rank_state(path, "policy", engine)              # on every rank, collectively
"""

from mars_megatron.checkpoint.rank_state import (
    load_rank_state,
    parallel_layout,
    python_rng_state,
    save_rank_state,
    set_python_rng_state,
)
from mars_megatron.checkpoint.store import STATE_FILE, CheckpointError, CheckpointStore, checkpoint_name

__all__ = [
    "STATE_FILE",
    "CheckpointError",
    "CheckpointStore",
    "checkpoint_name",
    "load_rank_state",
    "parallel_layout",
    "python_rng_state",
    "save_rank_state",
    "set_python_rng_state",
]
