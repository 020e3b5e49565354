"""Training trajectories: positions, their order and group ids (inputs are picked in :mod:`.selection`).

A trajectory is Solver → Verifier1 → Corrector1 → Verifier2 → Corrector2 (capped by ``max_steps``).
The Solver samples a group of G per problem; each later position selects ``inputs_per_agent`` outputs
of the position before it and samples a group of G per selected input. A Corrector only takes
Verifier outputs that found errors, so a trajectory stops where a Verifier says ``Correct``.
"""

from enum import StrEnum
from typing import Literal

from mars_megatron.agents.roles import Role

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


def group_id(problem_id: str, position: Position, parent_id: str | None) -> str:
    """Identify a group: same problem, same position, same parent sample (so the same input)."""
    return f"{problem_id}/{position.value}/{parent_id or '-'}"
