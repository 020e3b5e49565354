"""Module-level workers for tests/test_nan_steps.py (spawned processes import them)."""

from __future__ import annotations

from typing import Any

import torch

from mars_megatron.algorithm.tensors import MicroBatch
from mars_megatron.config import OptimizerConfig, ParallelConfig
from mars_megatron.training import parallel
from mars_megatron.training.megatron_engine import lm_loss

TRAIN = [[(11 * i + 3 * j) % 1000 for j in range(20)] for i in range(4)]


def nan_loss(logprobs: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    loss, tokens = lm_loss(logprobs, mb)
    return loss * float("nan"), tokens


def steps_with_a_nan_step(hf: str, layout: dict[str, int], poison: bool) -> dict[str, Any]:
    """Three steps on the same batch; with ``poison`` the second step's loss (hence grads) is NaN."""
    from mars_megatron.jobs import load_engine

    pc = ParallelConfig(**layout)
    parallel.init_model_parallel(pc, seed=0)
    engine = load_engine(hf, pc, dtype=None, impl="local", optimizer=OptimizerConfig(lr=1e-3))
    first = engine.train_step(TRAIN, pack_length=40)
    snapshot = [p.detach().clone() for p in engine.model.parameters()]
    second = engine.train_step(TRAIN, nan_loss if poison else lm_loss, pack_length=40)
    unchanged = all(torch.equal(a, b) for a, b in zip(snapshot, engine.model.parameters(), strict=True))
    third = engine.train_step(TRAIN, pack_length=40)
    return {"steps": [first, second, third], "unchanged": unchanged}


def poisoned_and_clean(hf: str, layout: dict[str, int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`steps_with_a_nan_step` poisoned, then clean, each with a model and optimizer of its own, in one
    launch (one spawn and one set of imports for both)."""
    return steps_with_a_nan_step(hf, layout, True), steps_with_a_nan_step(hf, layout, False)
