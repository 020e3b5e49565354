"""Sampling settings of every agent call in an evaluation (kept apart from the runner so the CLI can
build its options without importing torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SamplingConfig:
    """Per-agent sampling; defaults are MarsRL's evaluation settings (MARSRL.md §1)."""

    max_tokens: int = 65536
    """Most output tokens per agent call."""
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = -1
    seed: int = 0
    """Base of every agent call's seed (see :func:`step_seed`)."""

    def params(self, seed: int) -> Any:
        """Engine sampling parameters for one call."""
        from mars_megatron.rollout.engine import SamplingParams

        return SamplingParams(self.max_tokens, self.temperature, self.top_p, self.top_k, seed=seed)
