"""Trainer-vs-engine log-prob mismatch: how far the policy the trainer computes is from the one that
sampled the tokens, per role, and which sequences are too far to train on (MIS).

The rollout engine and the trainer run the same weights through different kernels (and, for MoE models,
possibly different experts), so ``log p_trainer - log p_engine`` of a sampled token is not 0. Per token,
with ``d = log p_trainer - log p_engine``:

* ``abs_mean``: mean |d| over the response tokens.
* ``kl``: Schulman's k3 estimate of KL(engine || trainer) on the engine's samples, mean of
  ``exp(d) - 1 - d`` (non-negative, unbiased; d is log of the ratio r = p_trainer / p_engine).
* ``token_outliers``: the fraction of tokens with r outside ``[1/t, t]`` (``|d| > log t``).
* ``seq_outliers``: the fraction of sequences whose geometric-mean ratio ``exp(mean d)`` is outside
  ``[1/t, t]``. These are what masked importance sampling (``algorithm.mis``) leaves out of the loss:
  a sequence the trainer would score that differently was, in effect, not sampled from its policy.

Sums travel between ranks (:data:`SUM_KEYS`), and :func:`mismatch_metrics` turns them into means, so
data-parallel ranks add up exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

SUM_KEYS = ("tokens", "abs", "k3", "tokens_over", "seqs", "seqs_over")


@dataclass(frozen=True)
class SequenceMismatch:
    """One sequence's sums (see the module docstring) and whether it is an outlier."""

    tokens: int
    abs_sum: float
    k3_sum: float
    tokens_over: int
    outlier: bool

    def sums(self) -> tuple[float, ...]:
        """In :data:`SUM_KEYS` order."""
        return (self.tokens, self.abs_sum, self.k3_sum, self.tokens_over, 1.0, float(self.outlier))


def sequence_mismatch(trainer: torch.Tensor, engine: torch.Tensor, threshold: float) -> SequenceMismatch:
    """``trainer``/``engine``: the log-probs of one sequence's response tokens (same length)."""
    if trainer.shape != engine.shape:
        raise ValueError(f"trainer log-probs {tuple(trainer.shape)} vs engine {tuple(engine.shape)}")
    if not threshold > 1:
        raise ValueError(f"threshold must be > 1, got {threshold}")
    d = trainer.double() - engine.double()
    n = d.numel()
    if n == 0:
        return SequenceMismatch(0, 0.0, 0.0, 0, False)
    bound = math.log(threshold)
    return SequenceMismatch(
        tokens=n,
        abs_sum=float(d.abs().sum()),
        k3_sum=float((torch.expm1(d) - d).sum()),
        tokens_over=int((d.abs() > bound).sum()),
        outlier=bool(abs(float(d.mean())) > bound),
    )


def add_sums(into: list[float], seq: SequenceMismatch) -> None:
    for i, v in enumerate(seq.sums()):
        into[i] += v


def mismatch_metrics(sums: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """``mismatch/<group>/{abs_mean,kl,token_outliers,seq_outliers,tokens}`` from per-group sums (groups
    are roles, and ``all``); groups without tokens are left out."""
    out: dict[str, float] = {}
    for group, values in sums.items():
        s = dict(zip(SUM_KEYS, values, strict=True))
        if s["tokens"] <= 0:
            continue
        prefix = f"mismatch/{group}/"
        out[prefix + "abs_mean"] = s["abs"] / s["tokens"]
        out[prefix + "kl"] = s["k3"] / s["tokens"]
        out[prefix + "token_outliers"] = s["tokens_over"] / s["tokens"]
        out[prefix + "seq_outliers"] = s["seqs_over"] / s["seqs"]
        out[prefix + "tokens"] = s["tokens"]
    return out
