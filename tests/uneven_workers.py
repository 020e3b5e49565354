"""Module-level workers for tests/test_uneven_pipeline.py (spawned processes import them)."""

from __future__ import annotations

from mars_megatron.config import ParallelConfig
from mars_megatron.training import parallel


def convert_and_score(hf: str, mcore: str, out: str, seqs: list[list[int]]) -> list[list[float]] | None:
    """Write with stages of 1 + 2 layers, read back and score with 2 + 1."""
    from mars_megatron.convert import hf_to_mcore, mcore_to_hf
    from mars_megatron.jobs import load_engine

    write = ParallelConfig(pp=2, first_stage_layers=1)
    parallel.init_model_parallel(write, seed=0)
    hf_to_mcore(hf, mcore, write)
    read = ParallelConfig(pp=2, last_stage_layers=1)
    parallel.init_model_parallel(read, seed=0)
    mcore_to_hf(mcore, out, read, progress=False)
    engine = load_engine(mcore, read, dtype=None, impl="local")
    return engine.logprobs(seqs, micro_batch=2)
