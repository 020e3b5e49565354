"""Per-agent binary rewards (MARSRL.md §3) by the kind the agent graph gives a role: ``answer`` and
``verdict`` (``outcome`` rewards are set by the scheduler from what followed). Pure given an
AnswerChecker; verdicts are parsed elsewhere (``mars_megatron.agents.verdict``) and come in as
``bool | None``."""

from __future__ import annotations

from typing import Protocol

from mars_megatron.rewards.checker import CheckResult


class Checker(Protocol):
    def check_many(self, pairs: list[tuple[str, str | int | float]]) -> list[CheckResult]: ...


def answer_rewards(pairs: list[tuple[str, str | int | float]], checker: Checker) -> list[float]:
    """``answer`` rewards for a batch of (response, reference): 1.0 where the last boxed answer matches the
    reference, else 0.0 (no answer, unparseable and timed-out checks included)."""
    return [1.0 if result.correct else 0.0 for result in checker.check_many(pairs)]


def answer_reward(response: str, reference: str | int | float, checker: Checker) -> float:
    """The ``answer`` reward of one response; prefer ``answer_rewards`` for batches."""
    return answer_rewards([(response, reference)], checker)[0]


def verdict_reward(verdict: bool | None, solution_is_correct: bool) -> float:
    """The ``verdict`` reward: 1.0 if the verdict (True = the solution passes) is right about the solution
    it judged.

    ``solution_is_correct`` is that solution's own answer reward. An unparseable verdict (None) earns 0.0
    whatever the truth.
    """
    if verdict is None:
        return 0.0
    return 1.0 if verdict == solution_is_correct else 0.0
