"""Training trajectories: positions, the rollout record, and how each agent picks its inputs.

A trajectory is Solver → Verifier1 → Corrector1 → Verifier2 → Corrector2 (capped by ``max_steps``).
The Solver samples a group of G per problem; each later position selects ``inputs_per_agent`` outputs
of the position before it and samples a group of G per selected input. A Corrector only takes
Verifier outputs that found errors, so a trajectory stops where a Verifier says ``Correct``.
"""

import random
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from mars_megatron.agents.roles import Message, Role

Strategy = Literal["random", "balanced", "adaptive"]
_STRATEGIES = ("random", "balanced", "adaptive")


class Position(StrEnum):
    """A step of the training trajectory. Verifier1/2 share prompts but are trained as separate
    positions so the Verifier sees both Solver-style and Corrector-style solutions."""

    SOLVER = "solver"
    VERIFIER_1 = "verifier_1"
    CORRECTOR_1 = "corrector_1"
    VERIFIER_2 = "verifier_2"
    CORRECTOR_2 = "corrector_2"

    @property
    def role(self) -> Role:
        return Role(self.value.split("_")[0])


_ORDER = tuple(Position)


def positions(max_steps: int) -> tuple[Position, ...]:
    """The positions of a trajectory of ``agents.max_steps`` steps, in order from the Solver."""
    return _ORDER[:max_steps]


def next_position(position: Position, max_steps: int) -> Position | None:
    """The position fed by ``position``'s outputs, or None at the end of a ``max_steps`` trajectory."""
    index = _ORDER.index(position) + 1
    return _ORDER[index] if index < max_steps else None


@dataclass
class RolloutRecord:
    """One sampled agent output, from rollout to training (rewards are filled in after scoring)."""

    sample_id: str
    problem_id: str
    position: Position
    messages: list[Message]
    """The input the policy saw."""
    output_text: str
    parent_id: str | None = None
    """The sample this input was built from (None for the Solver)."""
    reward: float | None = None
    verdict: bool | None = None
    """Verifier outputs only: the parsed verdict (None: unparseable, or not a Verifier)."""

    @property
    def role(self) -> Role:
        return self.position.role

    @property
    def group_id(self) -> str:
        """Samples sharing this id share role and input, so GRPO normalises over them."""
        return group_id(self.problem_id, self.position, self.parent_id)

    @property
    def found_errors(self) -> bool:
        """A Verifier output that judged its solution ``Wrong`` (an unparseable one found nothing)."""
        return self.role is Role.VERIFIER and self.verdict is False


def group_id(problem_id: str, position: Position, parent_id: str | None) -> str:
    """Identify a group: same problem, same position, same parent sample (so the same input)."""
    return f"{problem_id}/{position.value}/{parent_id or '-'}"


def eligible_inputs(candidates: Sequence[RolloutRecord], role: Role) -> list[RolloutRecord]:
    """Outputs that ``role`` may take as input: solutions for the Verifier, error reports for the
    Corrector (a Verifier that said ``Correct`` ends its branch)."""
    if role is Role.VERIFIER:
        return [c for c in candidates if c.role in (Role.SOLVER, Role.CORRECTOR)]
    if role is Role.CORRECTOR:
        return [c for c in candidates if c.found_errors]
    raise ValueError(f"select_inputs: the {role.value} takes no agent output as input")


def _is_positive(record: RolloutRecord) -> bool:
    if record.reward is None:
        raise ValueError(f"select_inputs: sample {record.sample_id} has no reward yet")
    return record.reward > 0


def select_inputs(
    candidates: Sequence[RolloutRecord],
    k: int,
    strategy: Strategy,
    role: Role,
    rng: random.Random,
) -> list[RolloutRecord]:
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
