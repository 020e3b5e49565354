"""How each later position picks its inputs among the outputs of its input position.

A position takes the outputs that qualify (``when``: any, or only those whose verdict failed or passed)
and :func:`select_inputs` picks ``k`` of them by strategy. The candidates are the run's own records
(:class:`~mars_megatron.agents.sample.Sample`), scored.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, get_args

from mars_megatron.agents.graph import Strategy, When

if TYPE_CHECKING:
    from mars_megatron.agents.sample import Sample

_STRATEGIES = get_args(Strategy)


def eligible_inputs(candidates: Sequence[Sample], when: When = "any") -> list[Sample]:
    """The candidates a position may take: all, those whose verdict failed (``rejected``: a report that
    found errors; an unparseable verdict found nothing) or those whose verdict passed (``accepted``)."""
    if when == "any":
        return list(candidates)
    if when == "rejected":
        return [c for c in candidates if c.verdict is False]
    if when == "accepted":
        return [c for c in candidates if c.verdict is True]
    raise ValueError(f"select_inputs: unknown when {when!r}; expected any, rejected or accepted")


def _is_positive(record: Sample) -> bool:
    if record.reward is None:
        raise ValueError(f"select_inputs: sample {record.sample_id} has no reward yet")
    return record.reward > 0


def select_inputs(
    candidates: Sequence[Sample],
    k: int,
    strategy: Strategy,
    rng: random.Random,
    *,
    when: When = "any",
    prefer: str = "negative",
    positive_share: float = 0.5,
) -> list[Sample]:
    """Pick up to ``k`` distinct inputs from the eligible candidates.

    - ``random``: uniform without replacement.
    - ``balanced``: ``k // 2`` reward-positive inputs and the rest reward-0 ones (positives first in the
      result); a pool that runs short is made up from the other.
    - ``custom``: as balanced with ``int(k * positive_share)`` positives.
    - ``adaptive``: the inputs the position learns most from first (``prefer``: ``negative`` — reward 0,
      e.g. wrong solutions for a judge — or ``positive`` — e.g. reports whose errors are real, for a
      reviser), the rest only to fill up.

    Fewer than ``k`` eligible inputs returns them all (still ordered by the strategy). Deterministic
    for a given ``rng`` state.
    """
    if k < 0:
        raise ValueError(f"select_inputs: k must be >= 0, got {k}")
    pool = eligible_inputs(candidates, when)
    positives = [c for c in pool if _is_positive(c)]
    negatives = [c for c in pool if not _is_positive(c)]
    if strategy == "random":
        return rng.sample(pool, min(k, len(pool)))
    if strategy in ("balanced", "custom"):
        share = 0.5 if strategy == "balanced" else positive_share
        num_pos = min(len(positives), k // 2 if strategy == "balanced" else int(k * share))
        num_neg = min(len(negatives), k - num_pos)
        num_pos = min(len(positives), k - num_neg)
        return rng.sample(positives, num_pos) + rng.sample(negatives, num_neg)
    if strategy == "adaptive":
        preferred, rest = (negatives, positives) if prefer == "negative" else (positives, negatives)
        first = rng.sample(preferred, min(k, len(preferred)))
        return first + rng.sample(rest, min(k - len(first), len(rest)))
    raise ValueError(f"select_inputs: unknown strategy {strategy!r}; expected one of {_STRATEGIES}")
