"""Module-level functions the warm-start tests run on spawned gloo ranks via ``parallel.launch``."""

from __future__ import annotations

from mars_megatron.config import ParallelConfig
from mars_megatron.training import parallel


def score_checkpoint(model_dir: str, seqs: list[list[int]]) -> list[list[float]] | None:
    """Per-token log-probs of ``seqs`` under a checkpoint loaded the way ``mars train`` loads it."""
    from mars_megatron.jobs import load_engine

    layout = ParallelConfig()
    parallel.init_model_parallel(layout, seed=0)
    engine = load_engine(model_dir, layout, dtype=None, impl="local")
    return engine.logprobs(seqs, micro_batch=len(seqs))
