"""Training trajectories: positions, their order and group ids (inputs are picked in :mod:`.selection`).

A trajectory is Solver → Verifier1 → Corrector1 → Verifier2 → Corrector2 (capped by ``max_steps``).
The Solver samples a group of G per problem; each later position selects ``inputs_per_agent`` outputs
of the position before it and samples a group of G per selected input. A Corrector only takes
Verifier outputs that found errors, so a trajectory stops where a Verifier says ``Correct``.
"""

from dataclasses import dataclass
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


@dataclass(frozen=True)
class TrainingConfig:
    """Shape of the grouped agentic rollout; defaults are MarsRL's."""

    group_size: int = 8
    """G: samples drawn per input (per problem for the Solver)."""
    inputs_per_agent: int = 2
    """Outputs of the previous position each later position selects as inputs."""
    max_steps: int = 5
    """Positions per trajectory, 1..5, taken in order from Solver."""
    strategy: Strategy = "adaptive"
    """How inputs are selected; see :func:`select_inputs`."""

    def __post_init__(self) -> None:
        for name in ("group_size", "inputs_per_agent"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainingConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.max_steps <= len(_ORDER):
            raise ValueError(f"TrainingConfig.max_steps must be in 1..{len(_ORDER)}, got {self.max_steps}")
        if self.strategy not in _STRATEGIES:
            raise ValueError(f"TrainingConfig.strategy must be one of {_STRATEGIES}, got {self.strategy!r}")

    @property
    def positions(self) -> tuple[Position, ...]:
        return _ORDER[: self.max_steps]

    def next_position(self, position: Position) -> Position | None:
        """The position fed by ``position``'s outputs, or None at the end of the trajectory."""
        index = _ORDER.index(position) + 1
        return _ORDER[index] if index < self.max_steps else None


def group_id(problem_id: str, position: Position, parent_id: str | None) -> str:
    """Identify a group: same problem, same position, same parent sample (so the same input)."""
    return f"{problem_id}/{position.value}/{parent_id or '-'}"
