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

    def __post_init__(self) -> None:
        """Checked when built, so ``mars eval`` refuses a bad flag before it writes anything (messages
        name the flag)."""
        import math

        from mars_megatron.config import INT_MAX, MAX_TOKENS

        problems = []
        if self.max_tokens < 1:
            problems.append(f"--max-tokens must be >= 1, got {self.max_tokens}")
        elif self.max_tokens > MAX_TOKENS:  # the bound of the config's token budgets
            problems.append(f"--max-tokens must be <= {MAX_TOKENS}, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            problems.append(f"--temperature must be a finite number >= 0, got {self.temperature}")
        elif self.temperature > 10:  # as evaluation.temperature: above it, sampling is noise
            problems.append(f"--temperature must be <= 10, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            problems.append(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            problems.append(f"--top-k must be -1 (off) or >= 1, got {self.top_k}")
        elif self.top_k > INT_MAX:  # engines hold top-k in int32 tensors
            problems.append(f"--top-k must be <= {INT_MAX}, got {self.top_k}")
        if not 0 <= self.seed < 2**31:
            problems.append(f"--seed must be in [0, 2**31), got {self.seed}")
        if problems:
            raise ValueError("; ".join(problems))

    def params(self, seed: int) -> Any:
        """Engine sampling parameters for one call."""
        from mars_megatron.rollout.engine import SamplingParams

        return SamplingParams(self.max_tokens, self.temperature, self.top_p, self.top_k, seed=seed)
