"""Module-level workers for tests/test_checkpoint_trust.py (spawned ranks import them by module path)."""

from __future__ import annotations

from pathlib import Path

from mars_megatron.config import OptimizerConfig, ParallelConfig
from mars_megatron.training import parallel


def resume_errors(hf_dir: str, checkpoints: list[str], policy: str) -> list[tuple[str, str]]:
    """``load_rank_state`` (what ``mars train --resume`` runs on every rank) of each checkpoint into one
    engine: ``(exception type, message)`` each, ``("", "")`` when it loaded. Single-rank world."""
    from mars_megatron.checkpoint import load_rank_state
    from mars_megatron.jobs import load_engine

    pc = ParallelConfig()
    parallel.init_model_parallel(pc, seed=0)
    engine = load_engine(hf_dir, pc, dtype=None, impl="local", optimizer=OptimizerConfig(lr=1e-2))
    results = []
    for checkpoint in checkpoints:
        try:
            load_rank_state(Path(checkpoint), policy, engine)
        except Exception as e:
            results.append((type(e).__name__, str(e)))
        else:
            results.append(("", ""))
    return results
