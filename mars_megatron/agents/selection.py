"""How each later agent picks its inputs among the previous position's outputs.

A Verifier takes solutions (Solver or Corrector outputs), a Corrector takes Verifier outputs that found
errors; :func:`select_inputs` picks ``inputs_per_agent`` of them by strategy. The candidates are the
run's own records (:class:`~mars_megatron.agents.sample.Sample`), scored.
"""

import random
from collections.abc import Sequence

from mars_megatron.agents.roles import Role
from mars_megatron.agents.sample import Sample
from mars_megatron.agents.trajectory import _STRATEGIES, Strategy


def eligible_inputs(candidates: Sequence[Sample], role: Role) -> list[Sample]:
    """Outputs that ``role`` may take as input: solutions for the Verifier, error reports for the
    Corrector (a Verifier that said ``Correct`` ends its branch)."""
    if role is Role.VERIFIER:
        return [c for c in candidates if c.role in (Role.SOLVER, Role.CORRECTOR)]
    if role is Role.CORRECTOR:
        return [c for c in candidates if c.found_errors]
    raise ValueError(f"select_inputs: the {role.value} takes no agent output as input")


def _is_positive(record: Sample) -> bool:
    if record.reward is None:
        raise ValueError(f"select_inputs: sample {record.sample_id} has no reward yet")
    return record.reward > 0


def select_inputs(
    candidates: Sequence[Sample],
    k: int,
    strategy: Strategy,
    role: Role,
    rng: random.Random,
) -> list[Sample]:
    """Pick up to ``k`` distinct inputs for ``role`` from the previous position's outputs.

    - ``random``: uniform without replacement.
    - ``balanced``: ``k // 2`` reward-1 inputs and ``k - k // 2`` reward-0 ones (reward-1 first in
      the result); a pool that runs short is made up from the other.
    - ``adaptive``: the inputs the role learns most from first, the rest only to fill up: the
      Verifier prefers incorrect solutions (reward 0), the Corrector prefers reports whose errors
      are real (Verifier reward 1).

    Fewer than ``k`` eligible inputs returns them all (still ordered by the strategy). Deterministic
    for a given ``rng`` state.
    """
    if k < 0:
        raise ValueError(f"select_inputs: k must be >= 0, got {k}")
    pool = eligible_inputs(candidates, role)
    positives = [c for c in pool if _is_positive(c)]
    negatives = [c for c in pool if not _is_positive(c)]
    if strategy == "random":
        return rng.sample(pool, min(k, len(pool)))
    if strategy == "balanced":
        num_pos = min(len(positives), k // 2)
        num_neg = min(len(negatives), k - num_pos)
        num_pos = min(len(positives), k - num_neg)
        return rng.sample(positives, num_pos) + rng.sample(negatives, num_neg)
    if strategy == "adaptive":
        preferred, rest = (negatives, positives) if role is Role.VERIFIER else (positives, negatives)
        first = rng.sample(preferred, min(k, len(preferred)))
        return first + rng.sample(rest, min(k - len(first), len(rest)))
    raise ValueError(f"select_inputs: unknown strategy {strategy!r}; expected one of {_STRATEGIES}")
