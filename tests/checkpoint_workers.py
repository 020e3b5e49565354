"""Module-level workers for tests/test_checkpoint.py (spawned ranks import them by module path).

Each training step draws its batch from all three global RNGs (python ``random`` picks the sequences,
numpy their lengths, torch their tokens), so a resumed run only reproduces the uninterrupted one if the
RNG states come back along with the model and the optimizer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mars_megatron.config import OptimizerConfig, ParallelConfig
from mars_megatron.training import parallel

POOL = [[(7 * i + 13 * j) % 1000 for j in range(24)] for i in range(16)]
GLOBAL_BATCH = 4
PACK_LENGTH = 48  # tokens per pack; the batch's sequences hold 9..24 tokens
POLICY = "policy"


@dataclass(frozen=True)
class Run:
    """Train steps ``first..last`` (1-based) in layout ``layout``; save after step ``save_after`` (0:
    before the first) into ``save_dir``; or, with ``resume_dir``, first load the state saved there (after
    clobbering every RNG).
    ``wrong_layout``: also try to load ``resume_dir`` into this other layout and report the error."""

    name: str
    hf_dir: str
    layout: dict[str, Any]
    first: int
    last: int
    save_dir: str | None = None
    save_after: int | None = None
    resume_dir: str | None = None
    wrong_layout: dict[str, Any] | None = None


def _batch() -> list[list[int]]:
    picks = random.sample(range(len(POOL)), GLOBAL_BATCH)
    lengths = np.random.randint(8, 24, size=GLOBAL_BATCH).tolist()
    noise = torch.randint(0, 1000, (GLOBAL_BATCH,)).tolist()
    return [[noise[k], *POOL[p][:n]] for k, (p, n) in enumerate(zip(picks, lengths, strict=True))]


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _engine(hf_dir: str, layout: dict[str, Any]) -> Any:
    from mars_megatron.jobs import load_engine

    pc = ParallelConfig(**layout)
    parallel.init_model_parallel(pc, seed=0)
    return load_engine(hf_dir, pc, dtype=None, impl="local", optimizer=OptimizerConfig(lr=1e-2))


def _weights(engine: Any) -> dict[str, np.ndarray]:
    """This rank's parameters (numpy: torch tensors would travel to the parent as shared memory, which
    is gone once the rank exits)."""
    inner = getattr(engine.model, "module", engine.model)
    return {k: v.detach().numpy().copy() for k, v in inner.state_dict().items() if torch.is_tensor(v)}


def run(runs: list[Run]) -> dict[str, dict[str, Any]]:
    """Every run on this rank, in order; per run the metrics of each step, the final weights of this
    rank's shard, the next draws of each RNG, and the layout-mismatch error (if asked for)."""
    out = {}
    for r in runs:
        try:
            out[r.name] = _run(r)
        except Exception as e:  # name the run in the traceback that launch() reports
            raise RuntimeError(f"run {r.name!r} failed: {type(e).__name__}: {e}") from e
    return out


def _run(r: Run) -> dict[str, Any]:
    from mars_megatron.checkpoint import load_rank_state, save_rank_state

    result: dict[str, Any] = {"wrong_layout_error": None}
    if r.wrong_layout is not None:
        engine = _engine(r.hf_dir, r.wrong_layout)
        try:
            load_rank_state(Path(r.resume_dir), POLICY, engine)
        except Exception as e:
            result["wrong_layout_error"] = (type(e).__name__, str(e))
    engine = _engine(r.hf_dir, r.layout)
    _seed_all(1234)
    if r.resume_dir is not None:
        _seed_all(999)  # the run that resumes must get the saved states back, not these
        engine.skipped_steps = 99  # so is the skipped-step counter
        load_rank_state(Path(r.resume_dir), POLICY, engine)
    if r.save_after == r.first - 1:  # a checkpoint before any step
        save_rank_state(Path(r.save_dir), POLICY, engine)
    steps = []
    for step in range(r.first, r.last + 1):
        steps.append(engine.train_step(_batch(), pack_length=PACK_LENGTH))
        if step == r.save_after:
            save_rank_state(Path(r.save_dir), POLICY, engine)
    result["steps"] = steps
    result["weights"] = _weights(engine)
    result["skipped_steps"] = engine.skipped_steps
    result["draws"] = [random.random(), float(np.random.rand()), float(torch.rand(()))]
    return result
