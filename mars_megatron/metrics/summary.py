"""How much a run learned: each role's mean reward at the start and at the end of ``metrics.jsonl``.

Per-step rewards are noisy (a step sees a handful of problems), so the start and the end are means over a
window of steps; a step in which a role had no samples (logged as null) is left out of its mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RewardRise:
    role: str
    start: float
    end: float

    @property
    def rise(self) -> float:
        return self.end - self.start


def _mean(records: Sequence[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in records if r.get(key) is not None]
    if not values:
        raise ValueError(f"no step in the window logged {key!r}")
    return sum(values) / len(values)


def reward_rise(records: Sequence[dict[str, Any]], window: int = 10) -> list[RewardRise]:
    """Mean ``reward/<role>`` over the first and the last ``window`` steps, per role (the roles of the run's
    agent graph: every ``reward/<role>`` key the records hold, in the order first logged)."""
    if window < 1 or len(records) < 2 * window:
        raise ValueError(
            f"reward_rise: need at least {2 * window} steps, got {len(records)} (window {window})"
        )
    head, tail = records[:window], records[-window:]
    roles = list(
        dict.fromkeys(k.removeprefix("reward/") for r in records for k in r if k.startswith("reward/"))
    )
    return [RewardRise(role, _mean(head, f"reward/{role}"), _mean(tail, f"reward/{role}")) for role in roles]


def training_seconds(records: Sequence[dict[str, Any]]) -> float:
    """Wall time of the logged steps (rollout, train, sync), excluding start-up."""
    return float(sum(r["time/step"] for r in records))
